"""shard: train Transformers on any device mesh; the parallel layout is data, not code.

The public API is the names listed here: import them from `shard` (`from shard import train, make_layout`),
and the config room whole as `from shard import config`. The modules behind them may move. Each name
loads on first use, so `import shard` starts no JAX.
"""

import importlib

from shard.errors import ShardError

__version__ = "0.1.0"

# name -> the module that defines it
_API = {
    # the mesh and the layout
    "MeshSpec": "shard.sharding.mesh", "parse_mesh": "shard.sharding.mesh", "build_mesh": "shard.sharding.mesh",
    "Layout": "shard.sharding.rules", "constrain": "shard.sharding.rules",
    "activation_layout": "shard.sharding.rules", "make_layout": "shard.sharding.layout",
    # the model's configs
    "TrainConfig": "shard.config.train", "ModelConfig": "shard.config.model", "PRESETS": "shard.config.presets",
    # training
    "state_spec": "shard.training.state", "init_state": "shard.training.state",
    "make_train_step": "shard.training.step", "batch_sharding": "shard.training.step",
    "compile_step": "shard.training.compiled", "memory_of": "shard.training.compiled",
    "prepare": "shard.training.prepare", "train": "shard.training.loop", "Observer": "shard.training.observer",
    "StopOnSignal": "shard.training.preemption",
    "Generator": "shard.training.generate", "Sampling": "shard.training.generate",
    # data
    "ByteTokenizer": "shard.data.tokenizers", "Tokenizer": "shard.data.tokenizers",
    "load_tokenizer": "shard.data.tokenizers", "train_bpe": "shard.data.tokenizers",
    "prepare_store": "shard.data.store", "TokenStore": "shard.data.store",
    # checkpoints
    "Checkpoints": "shard.run.checkpoint", "SaveCheckpoints": "shard.run.checkpoint",
    # measuring and planning
    "analyze": "shard.measure.analysis", "plan": "shard.measure.plan",
    "find_hardware": "shard.hardware", "load_hardware": "shard.hardware",
    # what a run writes
    "JsonlWriter": "shard.observe.metrics", "TensorBoardWriter": "shard.observe.metrics",
    "read_jsonl": "shard.observe.metrics",
}

__all__ = ["ShardError", "__version__", "config", *_API]


def __getattr__(name: str):
    if name == "config":  # the config room whole (a subpackage: importing it binds it here)
        return importlib.import_module("shard.config")
    if name not in _API:
        raise AttributeError(f"module 'shard' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # the next lookup finds it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))

