"""What the commands share: their option types, the config layered from a file, flags and --set, the
checkpoint a reading command is given, and how a command starts JAX and prints the start's notices."""

from pathlib import Path
from typing import Annotated

import typer

from shard import MeshSpec
from shard import config as config_mod
from shard.errors import ShardError
from shard.observe.console import note, warn
from shard.run import devices

# Options shared by the commands that build a mesh and a model.
MeshOpt = Annotated[str | None, typer.Option("--mesh", help="8x4 | data=2,fsdp=2,model=2 | preset (shard/meshes/) | preset:4x2")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="model preset: tiny, small, moe-tiny, llama-1b, llama-7b, ...")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML config file")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override a config key: --set optimizer.lr=3e-4")]
PlanSetOpt = Annotated[list[str] | None, typer.Option("--set", help="override a model key: --set model.remat=full")]
SimOpt = Annotated[int | None, typer.Option("--simulate-devices", help="CPU devices to simulate in each process (default: what the mesh needs, 8 to fill)")]
CheckpointArg = Annotated[str | None, typer.Argument(help="run dir, its checkpoints/ dir, or one step's dir", show_default=False)]
CheckpointOpt = Annotated[str | None, typer.Option("--checkpoint", help="the same, as an option", show_default=False)]
# generate and eval also read a Hugging Face folder
WeightsArg = Annotated[str | None, typer.Argument(help="a shard checkpoint or run dir, or a Hugging Face folder", show_default=False)]


def checkpoint_given(positional: str | None, option: str | None) -> str:
    """The checkpoint a reading command was given, as its first argument or as --checkpoint (both work)."""
    if positional is None and option is None:
        raise ShardError("give a checkpoint: a run dir, its checkpoints/ dir or one step's dir, as the first "
                         "argument or as --checkpoint")
    if positional is not None and option is not None:
        raise ShardError("give the checkpoint once: as the first argument or as --checkpoint")
    return positional if positional is not None else option


def config_file(config: Path | None) -> dict:
    """The --config file's table ({} without one), read once per command."""
    return config_mod.load_file(str(config)) if config else {}


# The config key each flag sets.
FLAG_KEYS = {"mesh": "mesh.spec", "model": "model.name", "steps": "steps", "batch": "data.batch",
             "seq": "data.seq_len", "data": "data.path", "seed": "seed", "run_dir": "run_dir",
             "simulate_devices": "mesh.simulate_devices", "log_every": "log_every",
             "compile_cache": "xla.compile_cache",
             "checkpoint_every": "checkpoint.every", "keep": "checkpoint.keep",
             "cross_host": "cluster.cross_host", "failure_timeout": "cluster.failure_timeout", "bind": "cluster.bind",
             "eval_every": "eval.every", "init_from": "init_from", "tokenizer": "data.tokenizer",
             "packing": "data.packing", "wandb": "tracking.project", "task": "task", "reward": "grpo.rewards"}


def flag_settings(**flags) -> dict:
    """The config keys the flags given set, as one nested dict (a flag left out sets nothing)."""
    return config_mod.nested({FLAG_KEYS[k]: v for k, v in flags.items() if v is not None})


def overrides(from_file: dict, sets: list[str] | None, base: dict | None = None, **flags) -> dict:
    """defaults < base (a resumed run's config) < config file < flags < --set, as one nested dict."""
    return config_mod.layer(base, from_file, flag_settings(**flags), sets or [])


def check_rules_only(sets: list[str] | None, command: str) -> None:
    """generate and eval take the model from the checkpoint: --set may change only how it is laid out."""
    others = set(config_mod.parse_sets(sets or [])) - {"rules", "param_rules", "param_regex"}
    if others:
        raise ShardError(f"{command} takes rules.*, param_rules.* and param_regex.* in --set (the model comes with "
                         f"the checkpoint), got {sorted(others)[0]}")


def start_devices(cfg: config_mod.TrainConfig, mesh_spec: MeshSpec, compile_cache: Path | None = None,
                  cluster=None):
    """shard.run.devices.start_devices, its warning and note printed on stderr."""
    return devices.start_devices(cfg, mesh_spec, compile_cache, cluster, warn=warn, note=note)
