"""aotgrad's cache entries in torch's portable cache artifacts (the "mega-cache").

    artifacts, info = torch.compiler.save_cache_artifacts()     # after compiling: Inductor's, aotgrad's, ...
    # another machine or job, a fresh process:
    import aotgrad                                              # registers the "aotgrad" artifact type
    torch.compiler.load_cache_artifacts(artifacts)              # writes the entries into the caches
    torch.compile(model, backend="aotgrad")(x)                  # aotgrad cache hits, Inductor FX-graph hits

Each entry aotgrad's on-disk cache writes or reads (cache.py, through its `entry_hooks`) is recorded with torch's
`CacheArtifactManager` under its key, as the file's bytes (header, versions, SHA-256 and payload), as
Inductor records its FX-graph entries. Loading them writes the files into this process's aotgrad cache
folder; each is checked as any entry is when it is read (a file of another version or a damaged one is
ignored then, with a warning). torch's loader must know the "aotgrad" type before it reads a blob
holding it, so `import aotgrad` comes before `load_cache_artifacts`.
"""

from __future__ import annotations

import logging
import re

from torch.compiler._cache import CacheArtifact, CacheArtifactFactory, CacheArtifactManager

from . import cache

log = logging.getLogger("aotgrad.cache")

_TYPE = "aotgrad"
_KEY = re.compile(r"[0-9a-f]{64}")  # cache_key.digest: never a path


class AotgradCacheArtifact(CacheArtifact):
    """One aotgrad cache entry file, as torch's mega-cache carries it."""

    def populate_cache(self) -> None:
        if not _KEY.fullmatch(self.key):
            log.warning("aotgrad cache: ignoring a cache artifact with a malformed key %r", self.key[:80])
            return
        cache.write_entry(self.key, self.content)

    @staticmethod
    def type() -> str:
        return _TYPE


if _TYPE not in CacheArtifactFactory._artifact_types:  # registered once per process
    CacheArtifactFactory.register(AotgradCacheArtifact)


def record(key: str, data: bytes) -> None:
    """Put an entry's file into what `torch.compiler.save_cache_artifacts()` returns."""
    CacheArtifactManager.record_artifact(_TYPE, key, data)


if record not in cache.entry_hooks:
    cache.entry_hooks.append(record)
