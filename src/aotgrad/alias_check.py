"""The per-call aliasing check of backend graphs whose plan mutates inputs.

A plan traced while no two inputs shared memory is wrong for a call whose inputs do: a write to one
must show in the other. Dynamo does not guard every overlap (it matches an optimizer's parameters
and state by identity and `.grad` by presence), so the backend checks each call, and sends a call
that fails to plans traced per signature, for its aliasing.

The check, by what held at compile time:
- inputs aliased then (rare): the same aliasing now (`alias_key`);
- no overlap then, and the compiled code asserts its inputs' sizes (Inductor's): the tensors' byte
  ranges are disjoint, in one C++ call (`_disjoint_ranges_kernel`), about 3 us for the few hundred
  tensors of an optimizer step;
- otherwise, or until that function is built: distinct storages, in Python (about 30 us for the
  same tensors, 50-60 us when they come cold from a training step).
"""

from __future__ import annotations

import concurrent.futures
import logging
import operator
import threading
from collections.abc import Callable
from typing import Any

import torch

from .inputs import alias_key, is_wrapper, storage_id

log = logging.getLogger(__name__)


class AliasChecked:
    """Run the shape-generic plan while the inputs alias as at compile time, else per signature."""

    def __init__(self, run: Callable, leaves: list, make_fallback: Callable, *, sizes_asserted: bool):
        self.run, self.key, self.make_fallback = run, alias_key(leaves), make_fallback
        self.fallback = None
        # No two inputs shared memory at compile time (the common case): "all storages distinct"
        # is then the same check as comparing alias keys, at a fifth of the cost.
        self.distinct = None if self.key else [
            i for i, x in enumerate(leaves)
            if isinstance(x, torch.Tensor) and x.layout is torch.strided and not is_wrapper(x)
        ]
        self.disjoint = None
        self.extents = self.pick = self.build = None
        if sizes_asserted and _ranges_decide(self.distinct, leaves, run.plan):
            self.extents = torch.tensor([byte_extent(leaves[i]) for i in self.distinct], dtype=torch.int64)
            self.pick = _picker(self.distinct, len(leaves))
            self.build = _disjoint_ranges_kernel(len(self.distinct))

    def __call__(self, leaves) -> Any:
        if self.distinct is None:
            same = alias_key(leaves) == self.key
        else:
            if self.disjoint is None and self.build is not None and self.build.done():
                self.disjoint, self.build = self.build.result(), None
            if self.disjoint is not None:
                try:
                    self.disjoint(self.extents, *self.pick(leaves))
                    return self.run(leaves)
                except RuntimeError:  # overlap, or a tensor without data: the storage check decides
                    pass
            same = len({storage_id(leaves[i]) for i in self.distinct}) == len(self.distinct)
        if same:
            return self.run(leaves)
        if self.fallback is None:
            self.fallback = self.make_fallback()
        return self.fallback(leaves)


def _ranges_decide(distinct: list[int] | None, leaves: list, plan) -> bool:
    """Whether disjoint byte ranges are enough for the plan, with byte ranges fixed at compile time.

    Why that is sound: a plan that only writes input data (no metadata or storage mutation) computes
    the same whatever storage each input lies in, as long as no byte is shared: what a compiled
    graph reads and writes of an input lies within its range. The ranges are computed from the
    compile-time sizes and strides, so they must be fixed: static shapes, and compiled code that
    asserts them before running any kernel (Inductor's input asserts; Dynamo guards the sizes of
    ordinary inputs but not those of an optimizer's parameters, state and gradients).
    """
    if not distinct or len(distinct) < 2 or any(m.metadata or m.storage for m in plan.mutations):
        return False
    for i in distinct:
        x = leaves[i]
        if any(isinstance(v, torch.SymInt) for v in (*x.shape, *x.stride(), x.storage_offset())):
            return False
    return True


def byte_extent(t: torch.Tensor) -> int:
    """Bytes from a strided tensor's first element to just past its last one (0 when empty)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _picker(positions: list[int], n: int) -> Callable:
    """The leaves at `positions` (at least two), as cheaply as possible."""
    if positions == list(range(n)):
        return lambda leaves: leaves
    return operator.itemgetter(*positions)


# One build per number of tensors, shared by every graph of that size; one at a time.
_builds: dict[int, concurrent.futures.Future] = {}
_one_build_at_a_time = threading.Lock()


def _disjoint_ranges_kernel(n: int) -> concurrent.futures.Future:
    """A future of `check(extents, *tensors)`, which raises RuntimeError when two of the `n`
    tensors' byte ranges overlap (None where it cannot be built).

    It is C++ because reading a few hundred data pointers from Python costs more (14 us) than the
    whole check in C++ (2.8 us). Inductor's toolchain builds it (`CppPythonBindingsCodeCache`, which
    reads a tensor's data pointer in C++ without torch's headers) in a background thread: a second
    or two of compiler time that must not add to the compile; until it is ready, calls run the
    storage check. Inductor caches the library on disk: later runs load it at once. The thread is
    not a daemon: a script that ends during a build waits for it (a daemon thread stopped at exit
    inside torch's C++ aborts the process).
    """
    future = _builds.get(n)
    if future is None:
        future = _builds[n] = concurrent.futures.Future()

        def build():
            with _one_build_at_a_time:
                kernel = _build_disjoint_ranges_kernel(n)
            if kernel is None:  # a later graph tries again (the cache directory may have gone)
                _builds.pop(n, None)
            future.set_result(kernel)

        threading.Thread(target=build, name=f"aotgrad-overlap-check-{n}", daemon=False).start()
    return future


def wait_for_builds() -> None:
    """Wait until the background builds have finished (benchmarks, tests)."""
    concurrent.futures.wait(list(_builds.values()))


def _build_disjoint_ranges_kernel(n: int) -> Callable | None:
    """The compiled check if it builds and finds an overlap it is shown, else None."""
    try:
        kernel = compile_disjoint_ranges_kernel(n)
        tensors = [torch.zeros(4) for _ in range(n)]
        extents = torch.full((n,), 16, dtype=torch.int64)
        kernel(extents, *tensors)  # disjoint: passes
        try:
            kernel(extents, *tensors[:-1], tensors[0][1:])
        except RuntimeError:
            return kernel
        log.debug("aotgrad: the overlap check built for %d tensors missed an overlap; not used", n)
    except Exception as e:  # no C++ toolchain, another Inductor: the storage check stays
        log.debug("aotgrad: no C++ overlap check for %d tensors (%s: %s)", n, type(e).__name__, e)
    return None


def compile_disjoint_ranges_kernel(n: int) -> Callable:
    # Sorting the ranges by address is most of the cost, and the order rarely changes from call to
    # call: first check them in the last call's order (a permutation of all n, so any order proves
    # disjointness if it finds each range starting past the end of the one before), sort if not.
    source = f"""
        #include <algorithm>
        #include <cstdint>
        #include <stdexcept>
        #include <utility>

        extern "C" void kernel(const int64_t* extent, {", ".join(f"const void* p{i}" for i in range(n))}) {{
            constexpr int n = {n};
            const void* const pointer[n] = {{{", ".join(f"p{i}" for i in range(n))}}};
            thread_local int order[n];
            thread_local bool ordered = false;
            if (ordered) {{
                uintptr_t end = 0;
                int k = 0;
                for (; k < n; ++k) {{
                    const int i = order[k];
                    if (extent[i] <= 0) continue;
                    const uintptr_t start = reinterpret_cast<uintptr_t>(pointer[i]);
                    if (start < end) break;
                    end = start + static_cast<uintptr_t>(extent[i]);
                }}
                if (k == n) return;
            }}
            ordered = false;
            std::pair<uintptr_t, int> range[n];
            for (int i = 0; i < n; ++i) range[i] = {{reinterpret_cast<uintptr_t>(pointer[i]), i}};
            std::sort(range, range + n);
            uintptr_t end = 0;
            for (int k = 0; k < n; ++k) {{
                const int i = order[k] = range[k].second;
                if (extent[i] <= 0) continue;
                if (range[k].first < end) throw std::runtime_error("inputs overlap");
                end = range[k].first + static_cast<uintptr_t>(extent[i]);
            }}
            ordered = true;
        }}
    """
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(["const int64_t*"] + ["const void*"] * n, source)
