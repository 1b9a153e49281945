"""Training: the sharded state, the compiled step, the loop and its observers, evaluation and generation.
Their public names are shard's own (`from shard import prepare, train, Generator`); LoRA's adapters
(`lora`: split, merge, fold) are listed here."""

from shard._api import lazy_api

__getattr__, __dir__, __all__ = lazy_api("shard.training", {}, modules=("lora",))
