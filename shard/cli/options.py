"""What the commands share: their option types, the config layered from a file, flags and --set, the
checkpoint a reading command is given, and how a command starts JAX and prints the start's notices."""

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from shard import config as config_mod
from shard.errors import ShardError
from shard.observe.console import err_console
from shard.run import start
from shard.sharding.mesh import MeshSpec, parse_mesh

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


def warn(message: str) -> None:
    """A warning on stderr, in yellow (the text is not markup)."""
    err_console.print(f"[yellow]{escape(message)}[/yellow]", soft_wrap=True)


def note(message: str) -> None:
    """A side note on stderr, dimmed."""
    err_console.print(f"[dim]{escape(message)}[/dim]", soft_wrap=True)


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


def overrides(from_file: dict, sets: list[str] | None, base: dict | None = None, **flags) -> dict:
    """defaults < base (a resumed run's config) < config file < flags < --set, as one nested dict."""
    flag_keys = {"mesh": "mesh.spec", "model": "model.name", "steps": "steps", "batch": "data.batch",
                 "seq": "data.seq_len", "data": "data.path", "seed": "seed", "run_dir": "run_dir",
                 "simulate_devices": "mesh.simulate_devices", "log_every": "log_every",
                 "compile_cache": "xla.compile_cache",
                 "checkpoint_every": "checkpoint.every", "keep": "checkpoint.keep",
                 "cross_host": "cluster.cross_host", "failure_timeout": "cluster.failure_timeout", "bind": "cluster.bind",
                 "eval_every": "eval.every", "init_from": "init_from", "tokenizer": "data.tokenizer",
                 "packing": "data.packing", "wandb": "tracking.project", "task": "task"}
    if flags.get("run_dir") is not None and not flags["run_dir"].strip():
        raise ShardError("empty --run-dir: name a folder, or leave the flag out for runs/<model>-<mesh>-<time>")
    if flags.get("simulate_devices") is not None and flags["simulate_devices"] <= 0:
        raise ShardError(f"--simulate-devices must be positive, got {flags['simulate_devices']}")
    out = config_mod.merge(base or {}, from_file)
    flat = {flag_keys[k]: v for k, v in flags.items() if v is not None}
    out = config_mod.merge(out, config_mod.nested(flat))
    out = config_mod.merge(out, config_mod.parse_sets(sets or []))
    if isinstance(model := out.get("model"), dict):  # not: resolve says what else it is
        check_model_named_over_file(from_file.get("model"), model.get("name"))
    return out


def check_model_named_over_file(file_model, name) -> None:
    """A config file whose [model] describes one model whole (a run's config.toml lists every key)
    would amend the preset --model names into that model under the other name. A partial [model] (a
    recipe's remat or dtype) amends whichever model is named, as documented."""
    if not isinstance(file_model, dict) or file_model.get("name", name) == name:
        return
    if set(file_model) >= set(config_mod.field_names()):
        raise ShardError(f"--model {name}: the config file describes model {file_model['name']} whole (every "
                         f"[model] key, as a run's config.toml does), which would give {name} its dimensions; leave "
                         "out --model, or the file's [model] section")


def check_rules_only(sets: list[str] | None, command: str) -> None:
    """generate and eval take the model from the checkpoint: --set may change only how it is laid out."""
    others = set(config_mod.parse_sets(sets or [])) - {"rules", "param_rules", "param_regex"}
    if others:
        raise ShardError(f"{command} takes rules.*, param_rules.* and param_regex.* in --set (the model comes with "
                         f"the checkpoint), got {sorted(others)[0]}")


def start_devices(cfg: config_mod.TrainConfig, mesh_spec: MeshSpec, compile_cache: Path | None = None,
                  cluster=None):
    """shard.run.start.start_devices, its warning and note printed on stderr."""
    return start.start_devices(cfg, mesh_spec, compile_cache, cluster, warn=warn, note=note)


def host_jax(mesh: str = "1x1", simulate_devices: int | None = None, sets: list[str] | None = None):
    """Start JAX for a command that only needs a mesh (generate, import/export): devices as for train."""
    cfg = config_mod.resolve(overrides({}, sets, mesh=mesh, simulate_devices=simulate_devices))
    spec = parse_mesh(cfg.mesh.spec)
    return cfg, spec, start_devices(cfg, spec)
