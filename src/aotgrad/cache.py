"""A persistent on-disk cache of what aotgrad's torch.compile backends compile, for warm starts.

A restarted job (a notebook re-run, every rank of a multi-process job) compiles the same Dynamo
graphs again. With this cache, a graph compiled before comes back without tracing, analysis or
partitioning: Inductor's compiled code is loaded by the FX-graph key stored with the entry (no graph
unpickled or hashed again; cache_load.py), other compilers get the stored graphs, and the stored
plan goes to the run-time generator.

Where: `<Inductor's cache dir>/aotgrad/` (`TORCHINDUCTOR_CACHE_DIR`, else
`/tmp/torchinductor_<user>`), one file per key (cache_key.py). On by default; off with
`aotgrad.config.cache = False` or the environment variable `AOTGRAD_CACHE=0`. `cache_stats()`
counts hits and misses; each miss is logged with its reason on `logging.getLogger("aotgrad.cache")`.

Safety: each file holds a header (format, aotgrad and torch versions) and the SHA-256 of its payload;
a file that fails any check (truncated, corrupt, edited, another version) is ignored with one warning
and the graph is compiled again (and the entry rewritten). Files are written to a temporary name and
renamed into place, so concurrent writers never leave a torn entry. Entries are pickles, so the cache
refuses a directory that is not owned by this user or that others can write to.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from . import config
from .cache_key import FORMAT, Uncacheable, aotgrad_version, backend_key, digest, graph_key, torch_version
from .cache_load import ArtifactMissing, rebuild
from .cache_serialize import Recorder, dumps, loads, make_entry, on_compiled, with_backward

log = logging.getLogger("aotgrad.cache")

_MAGIC = b"AOTGRAD-CACHE\n"
# Called with (key, file bytes) for each entry written or read: cache_artifacts.py records them in
# torch's portable cache artifacts.
entry_hooks: list[Callable[[str, bytes], None]] = []
_STATS = {"hits": 0, "misses": 0, "uncacheable": 0, "stores": 0, "updates": 0, "corrupt": 0}


def enabled() -> bool:
    """On unless `aotgrad.config.cache` is False, `AOTGRAD_CACHE=0`, or torch's
    `torch.compiler.config.force_disable_caches` (which turns off every compile cache) is set."""
    if not config.cache or os.environ.get("AOTGRAD_CACHE", "1").strip().lower() in ("0", "false", "off"):
        return False
    from torch._inductor import config as inductor_config

    return not inductor_config.force_disable_caches


def cache_dir() -> str:
    """`<Inductor's cache dir>/aotgrad` (Inductor's `TORCHINDUCTOR_CACHE_DIR` convention)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return os.path.join(inductor_cache_dir(), "aotgrad")


def cache_stats(reset: bool = False) -> dict[str, int]:
    """Counters of this process: hits, misses (no usable entry, or Inductor no longer has its
    compiled code), uncacheable (no key could be computed), stores, updates (an entry rewritten
    with its backward's Inductor key once the backward compiled), corrupt (entries ignored)."""
    out = dict(_STATS)
    if reset:
        for k in _STATS:
            _STATS[k] = 0
    return out


def clear_cache() -> None:
    """Delete every entry (the `aotgrad/` folder under Inductor's cache dir)."""
    shutil.rmtree(cache_dir(), ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# The backend's hook
# ----------------------------------------------------------------------------------------------


class Probe:
    """One Dynamo graph's lookup: made before any pass changes the graph, used where the backend
    compiles the signature (`compile` loads the entry, or compiles and stores it)."""

    def __init__(self, parts: tuple):
        self.parts = parts

    def compile(self, backend: Any, compile_signature: Callable, fn, leaves: list, spec, aot_config) -> Callable:
        try:
            backend_parts = backend_key(backend)
        except Uncacheable as e:
            _uncacheable(str(e))
            return compile_signature(fn, leaves, spec, aot_config)
        key = digest((self.parts, backend_parts))
        if log.isEnabledFor(logging.DEBUG):  # which part changed, when a key unexpectedly misses
            log.debug("aotgrad cache: key %s: %s", key[:16],
                      ", ".join(f"{name}={digest(value)[:8]}" for name, value in (*self.parts, *backend_parts)))
        entry = _load(key)
        if entry is not None:
            try:
                run = rebuild(entry, leaves, aot_config, backend, _updater(key, entry))
            except ArtifactMissing as e:
                _STATS["misses"] += 1
                log.info("aotgrad cache: miss %s (%s); compiling again", key[:16], e)
            except Exception as e:  # noqa: BLE001 - a stale entry must never break a compile
                _STATS["corrupt"] += 1
                log.warning("aotgrad cache: entry %s could not be rebuilt (%s: %s); compiling again",
                            key[:16], type(e).__name__, e)
            else:
                _STATS["hits"] += 1
                log.info("aotgrad cache: hit %s", key[:16])
                return run
        recorder = Recorder()
        stored: list = []  # the entry once written: the lazy backward's Inductor key is added to it

        def backward_compiled(gm, artifact) -> None:  # not a backward re-traced under autocast
            if stored and gm is run.compiled.bw_module:
                _updater(key, stored[0])(artifact)

        recording = replace(
            aot_config,
            fw_compiler=recorder.wrap(aot_config.fw_compiler),
            inference_compiler=recorder.wrap(aot_config.inference_compiler),
            bw_compiler=on_compiled(aot_config.bw_compiler, backward_compiled),
        )
        run = compile_signature(fn, leaves, spec, recording)
        try:
            entry = make_entry(run, recorder)
            _store(key, entry)
            stored.append(entry)
        except Uncacheable as e:
            _uncacheable(str(e))
        except Exception as e:  # noqa: BLE001 - a failed store must never break a compile
            log.warning("aotgrad cache: could not write entry %s (%s: %s)", key[:16], type(e).__name__, e)
        return run


def _updater(key: str, entry) -> Callable:
    """What to call with a backward's Inductor artifact once it is compiled: the entry is written
    again with it, so the next hit loads the backward's compiled code too."""

    def update(artifact) -> None:
        new = with_backward(entry, artifact)
        if new is None:
            return
        try:
            _store(key, new, counter="updates")
        except Exception as e:  # noqa: BLE001 - a failed update must never break a backward
            log.warning("aotgrad cache: could not update entry %s (%s: %s)", key[:16], type(e).__name__, e)

    return update


def probe(backend: Any, gm, example_inputs, state: list) -> Probe | None:
    """A `Probe` for this graph, or None when the cache is off or no key can be computed."""
    if not enabled():
        return None
    try:
        return Probe(graph_key(backend, gm, example_inputs, state))
    except Uncacheable as e:
        _uncacheable(str(e))
        return None


def _uncacheable(reason: str) -> None:
    _STATS["uncacheable"] += 1
    log.info("aotgrad cache: not cached: %s", reason)


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


def _header() -> bytes:
    return f"format={FORMAT} aotgrad={aotgrad_version()} {torch_version()}\n".encode()


def _path(key: str) -> str:
    return os.path.join(cache_dir(), key[:2], key + ".bin")


def _safe_dir(path: str, create: bool) -> bool:
    """The folder exists (made private when `create`), is ours and no one else may write to it."""
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            log.warning("aotgrad cache: cannot create %s (%s); not caching", path, e)
            return False
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        _warn_once(path, f"aotgrad cache: {path} is writable by other users or not owned by this user; "
                         "not using the cache there (chmod go-w, or set TORCHINDUCTOR_CACHE_DIR)")
        return False
    return True


def _dirs_safe(path: str, create: bool) -> bool:
    root = cache_dir()
    return _safe_dir(root, create) and _safe_dir(os.path.dirname(path), create)


def _load(key: str):
    path = _path(key)
    if not os.path.exists(path):
        _STATS["misses"] += 1
        log.info("aotgrad cache: miss %s (no entry)", key[:16])
        return None
    if not _dirs_safe(path, create=False):
        _STATS["misses"] += 1
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
        entry = _decode(data)
    except Exception as e:  # noqa: BLE001 - whatever is wrong with the file, compile again
        _STATS["corrupt"] += 1
        _STATS["misses"] += 1
        _warn_once(path, f"aotgrad cache: ignoring entry {path}: {e}; compiling again")
        return None
    for hook in entry_hooks:  # a job that loaded it passes it on (save_cache_artifacts)
        hook(key, data)
    return entry


def _decode(data: bytes):
    if not data.startswith(_MAGIC):
        raise ValueError("not an aotgrad cache entry")
    rest = data[len(_MAGIC):]
    header, _, rest = rest.partition(b"\n")
    if header + b"\n" != _header():
        raise ValueError(f"written by another version ({header.decode(errors='replace')[:120]})")
    checksum, _, payload = rest.partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != checksum:
        raise ValueError("content hash mismatch (truncated or edited)")
    return loads(payload)


def _store(key: str, entry, counter: str = "stores") -> None:
    payload = dumps(entry)
    data = _MAGIC + _header() + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    if not write_entry(key, data):
        return
    for hook in entry_hooks:
        hook(key, data)
    _STATS[counter] += 1
    log.info("aotgrad cache: %s %s (%d bytes)", "stored" if counter == "stores" else "updated", key[:16], len(data))


def write_entry(key: str, data: bytes) -> bool:
    """Write an entry file atomically (a temporary name, then `os.replace`); False when the
    folder is not safe to use. Also how torch's cache artifacts are loaded (cache_artifacts.py)."""
    path = _path(key)
    if not _dirs_safe(path, create=True):
        return False
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".bin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return True


_warned: set[str] = set()


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning(message)
