"""The persistent compilation cache: a restart, a resume or the next run with the same shapes reads the
compiled step instead of compiling it again."""

import os
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
