"""The persistent compilation cache: a restart, a resume or the next run with the same shapes reads the
compiled step instead of compiling it again."""

import contextlib
import os
import sys
from pathlib import Path

from shard.errors import ShardError


def use_compile_cache(path: Path) -> None:
    """Cache compiled programs in `path` (unless the user configured JAX's cache already) in a way that
    hits across processes.

    A program with a custom-partitioned op (cuDNN's flash attention, over more than one device) holds
    the address of that op's Python partitioning callback, and JAX hashes it into the cache key, so
    every new process would miss. The address is dropped from the key, as MaxText's GPU recipes do; the
    rest of the program still decides the key. JAX_REMOVE_CUSTOM_PARTITIONING_PTR_FROM_CACHE_KEY set by
    the user wins.
    """
    import jax

    if not jax.config.jax_compilation_cache_dir:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            reason = "it is a file" if path.is_file() else e.strerror or str(e)
            raise ShardError(f"compile cache {path} can't be used: {reason}; choose another --compile-cache "
                             "or 'none'") from None
        jax.config.update("jax_compilation_cache_dir", str(path))
        # 0.1 s: the init (0.6-1.2 s on 2 CPU cores) and the checkpoint checksum (0.3-0.5 s, compiled
        # at every launch's first save under JAX's default of 1 s) are cached too; entries are ~100 KB
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    if "JAX_REMOVE_CUSTOM_PARTITIONING_PTR_FROM_CACHE_KEY" not in os.environ:
        jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", True)
    _check_entries()


_SUFFIX = "-cache"  # JAX's file cache names an entry <key>-cache (jax._src.lru_cache)


class CheckedEntries:
    """JAX's file cache, with entries written whole or not at all and unreadable ones removed.

    JAX writes an entry in place and never replaces one: a write cut short (a full disk, a kill -9)
    left a truncated entry that every later run failed to read ("incomplete or truncated stream"),
    warned about and compiled again, for good. Here an entry is written under a temporary name and
    renamed into place, a failed write names the entry's path, and an entry that does not decompress
    (one left by an older write) is removed, said in one line, and compiled and written again."""

    def __init__(self, inner, path: str | Path):
        self.inner, self.path = inner, Path(str(path))

    def get(self, key: str) -> bytes | None:
        from jax._src import compilation_cache

        value = self.inner.get(key)
        if value is None:
            return None
        try:
            compilation_cache.decompress_executable(value)
        except Exception as e:  # noqa: BLE001 - zstd's and zlib's errors differ
            entry = self.path / f"{key}{_SUFFIX}"
            with contextlib.suppress(OSError):
                entry.unlink()
            sys.stderr.write(f"removed an unreadable compile cache entry {entry} ({type(e).__name__}: {e}; a "
                             "write cut short by a full disk or a kill); compiling it again\n")
            return None
        return value

    def put(self, key: str, value: bytes) -> None:
        if getattr(self.inner, "eviction_enabled", False):  # JAX's cache keeps its own books: its own write
            self.inner.put(key, value)
            return
        entry = self.path / f"{key}{_SUFFIX}"
        if entry.exists():
            return
        partial = self.path / f".{key}{_SUFFIX}.{os.getpid()}.tmp"
        try:
            partial.write_bytes(value)
            os.replace(partial, entry)
        except OSError as e:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise OSError(e.errno, e.strerror, str(entry)) from None


def _check_entries() -> None:
    """Have JAX's persistent cache (made on its first use, or already made) check its entries."""
    from jax._src import compilation_cache

    if isinstance(compilation_cache._cache, CheckedEntries) or getattr(compilation_cache, "_shard_checked", False):
        return
    made = compilation_cache.get_file_cache

    def get_file_cache(path: str):
        found = made(path)
        return None if found is None else (CheckedEntries(found[0], found[1]), found[1])

    compilation_cache.get_file_cache = get_file_cache
    compilation_cache._shard_checked = True
    if compilation_cache._cache is not None and hasattr(compilation_cache._cache, "path"):
        compilation_cache._cache = CheckedEntries(compilation_cache._cache, compilation_cache._cache.path)
