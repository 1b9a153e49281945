"""shard: train Transformers on any device mesh; the parallel layout is data, not code.

The public API is the names listed here: import them from `shard` (`from shard import train, make_layout`),
and the config room whole as `from shard import config`. The modules behind them may move. Each name
loads on first use, so `import shard` starts no JAX.
"""

from shard._api import lazy_api
from shard.errors import ShardError

__version__ = "0.1.0"

# name -> the module that defines it
_API = {
    # the mesh and the layout
    "MeshSpec": "shard.sharding.mesh", "parse_mesh": "shard.sharding.mesh", "build_mesh": "shard.sharding.mesh",
    "resolve_shape": "shard.sharding.mesh",
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
    "prepare_store": "shard.data.store", "TokenStore": "shard.data.token_store",
    # a run as one call (what `shard train` runs), and weights from outside a run (generate, eval, export-hf)
    "run_training": "shard.run.training_run", "RunResult": "shard.run.training_run",
    "load_model": "shard.run.inference", "open_model": "shard.run.inference",
    # checkpoints
    "Checkpoints": "shard.run.checkpoint", "SaveCheckpoints": "shard.run.checkpoint",
    # measuring and planning
    "analyze": "shard.measure.analysis", "plan": "shard.measure.plan",
    "find_hardware": "shard.hardware", "load_hardware": "shard.hardware",
    # what a run writes
    "JsonlWriter": "shard.observe.metrics", "TensorBoardWriter": "shard.observe.metrics",
    "read_jsonl": "shard.observe.metrics",
}

# `from shard import config` gives the config room whole (a subpackage, which Python binds here on import)
__getattr__, __dir__, _names = lazy_api("shard", _API, ("config",))
__all__ = ["ShardError", "__version__", *_names]
