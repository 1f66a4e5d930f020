"""Inductor's CPU vector-ISA probe, run beside aotgrad's own work instead of before Inductor's.

Before Inductor loads or builds its first C++ kernel in a process it asks which vector instruction
sets work here: per candidate ISA it compiles a test library (cached on disk) and `dlopen`s it in a
child Python, about 1.3 s on two cores, all of it waiting on child processes. A process that loads
compiled code (a cache hit, a precompiled file) pays it on its path to the first step, upstream's
as well. aotgrad starts it in a thread when one of its calls begins to load or compile Inductor code
for CPU tensors, imports in the meantime what Inductor's generated modules import, and waits for it
before Inductor first asks. The probe's result is Inductor's own (`valid_vec_isa_list`, cached per
process); nothing is assumed about the machine. The thread never outlives the aotgrad call that
started it: `wait()` runs before that call returns to user code.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("aotgrad.inductor")

_thread: threading.Thread | None = None
_lock = threading.Lock()

# What the probe imports on first use: imported here, before the thread starts, so the two threads
# never import the same modules at once.
_PROBE_MODULES = ("torch._inductor.codecache", "torch._inductor.cpp_builder", "torch._inductor.cpu_vec_isa",
                  "torch.utils._filelock", "torch.utils.cpp_extension")
# What Inductor's generated CPU modules import (~1 s the first time): the main thread's work meanwhile.
_GENERATED_MODULE_IMPORTS = ("torch._inductor.select_algorithm", "torch._inductor.codegen.memory_planning",
                             "torch._inductor.async_compile", "torch._inductor.hooks")


def start(patches: dict | None = None) -> bool:
    """Start the probe in a thread unless it ran (or runs) already, or Inductor's options given
    for this compile decide it (`cpp.vec_isa_ok`, `cpp.simdlen`: the probe must read them as the
    compile sees them). True when a thread was started."""
    global _thread
    if patches and any(k.startswith("cpp.") and k.split(".")[1] in ("vec_isa_ok", "simdlen") for k in patches):
        return False
    import importlib

    try:
        for name in _PROBE_MODULES:
            importlib.import_module(name)
        from torch._inductor import config as inductor_config
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.valid_vec_isa_list.cache_info  # noqa: B018 - a torch whose probe is laid out otherwise
    except (ImportError, AttributeError):
        log.debug("aotgrad: Inductor's ISA probe is not where this torch keeps it; it runs in line")
        return False

    with _lock:
        if _thread is not None or cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
            return False
        if inductor_config.cpp.vec_isa_ok is not None or inductor_config.is_fbcode():
            return False  # no probe to hide
        _thread = threading.Thread(target=_probe, name="aotgrad-isa-probe", daemon=True)
        _thread.start()
    return True


def _probe() -> None:
    from torch._inductor import cpu_vec_isa

    try:
        cpu_vec_isa.valid_vec_isa_list()
    except Exception:  # Inductor probes again when it asks, and raises there if it must
        log.debug("aotgrad: Inductor's ISA probe failed in the background", exc_info=True)


def prefetch_imports() -> None:
    """Import what Inductor's generated CPU modules import, while the probe waits on its children."""
    import importlib

    for name in _GENERATED_MODULE_IMPORTS:
        importlib.import_module(name)


def wait() -> None:
    """Block until the probe started by `start` has finished (no-op when none runs): Inductor's
    `valid_vec_isa_list` caches without a lock, and asking it meanwhile would probe twice."""
    global _thread
    thread = _thread
    if thread is not None:
        thread.join()
        with _lock:
            if _thread is thread:
                _thread = None
