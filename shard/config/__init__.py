"""The run's configuration, without JAX: the training config's frozen sections (train.py), how defaults,
a TOML file, flags and `--set` become one (resolve.py), the model config (model.py) and its presets
(presets.py), MFU's FLOP count (flops.py), and rule tables (rules.py). `from shard import config` gives all of it:

    cfg = config.resolve(config.parse_sets(["model.name=tiny", "mesh.spec=fsdp"]))
"""

from shard.config.model import ModelConfig, field_names
from shard.config.flops import mfu_flops_per_token
from shard.config.presets import PRESETS
from shard.config.resolve import (differences, layer, load_file, merge, nested, parse_sets, parse_value, resolve,
                                  to_toml)
from shard.config.finetune import LoraConfig
from shard.config.train import (CheckpointConfig, ClusterConfig, DataConfig, EvalConfig, GuardConfig, MeshConfig,
                                ObserveConfig, OptimizerConfig, PipelineConfig, TrackingConfig, TrainConfig, XlaConfig)

__all__ = ["PRESETS", "CheckpointConfig", "ClusterConfig", "DataConfig", "EvalConfig", "GuardConfig", "MeshConfig",
           "LoraConfig", "ModelConfig", "ObserveConfig", "OptimizerConfig", "PipelineConfig", "TrackingConfig", "TrainConfig", "XlaConfig",
           "differences", "field_names", "layer", "load_file", "merge", "mfu_flops_per_token", "nested", "parse_sets",
           "parse_value", "resolve", "to_toml"]
