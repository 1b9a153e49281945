"""shard: train Transformers on any device mesh; the parallel layout is data, not code."""

from shard.errors import ShardError

__version__ = "0.1.0"
__all__ = ["ShardError", "__version__"]
