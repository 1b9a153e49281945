"""The `shard` command. JAX is imported only after the simulated device count is settled."""

import dataclasses
import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from shard import config as config_mod
from shard.errors import ShardError
from shard.mesh import MeshSpec, devices_needed, parse_mesh

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train Transformers on any device mesh: the parallel layout is data, not code.")
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

DEFAULT_FILL_DEVICES = 8

# Options shared by the commands that build a mesh and a model.
MeshOpt = Annotated[Optional[str], typer.Option("--mesh", help="8x4 | data=2,fsdp=2,model=2 | preset (meshes/) | preset:4x2")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", help="model preset: tiny, small, llama-1b, llama-7b, ...")]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="TOML config file")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="override a config key: --set optimizer.lr=3e-4")]
SimOpt = Annotated[Optional[int], typer.Option("--simulate-devices", help="CPU devices to simulate (default: what the mesh needs, 8 to fill)")]


def _overrides(config: Optional[Path], sets: Optional[list[str]], base: Optional[dict] = None, **flags) -> dict:
    """defaults < base (a resumed run's config) < config file < flags < --set, as one nested dict."""
    flag_keys = {"mesh": "mesh.spec", "model": "model.name", "steps": "steps", "batch": "data.batch",
                 "seq": "data.seq_len", "data": "data.path", "seed": "seed", "run_dir": "run_dir",
                 "simulate_devices": "mesh.simulate_devices", "log_every": "log_every",
                 "checkpoint_every": "checkpoint.every", "keep": "checkpoint.keep"}
    out = config_mod.merge(base or {}, config_mod.load_file(str(config)) if config else {})
    flat = {flag_keys[k]: v for k, v in flags.items() if v is not None}
    out = config_mod.merge(out, config_mod.parse_sets([f"{k}={json.dumps(v)}" for k, v in flat.items()]))
    return config_mod.merge(out, config_mod.parse_sets(sets or []))


def start_devices(cfg: config_mod.TrainConfig, mesh_spec: MeshSpec):
    """Settle the CPU device count, start JAX, and return the devices the mesh will use."""
    from shard.devices import request_host_devices

    wanted = cfg.mesh.simulate_devices or devices_needed(mesh_spec, DEFAULT_FILL_DEVICES)
    asked = request_host_devices(wanted)
    import jax

    devices = jax.devices()
    if asked and devices[0].platform == "cpu" and wanted > 1:
        err_console.print(f"[dim]simulating {len(devices)} CPU devices (XLA host platform); "
                          "set --simulate-devices to change[/dim]")
    return devices


def _fail(e: Exception):
    err_console.print(f"[red]error:[/red] {e}", soft_wrap=True)
    raise typer.Exit(2)


def _check_data_path(path: str) -> None:
    from shard.data import EMBEDDED, SYNTHETIC

    if path not in (EMBEDDED, SYNTHETIC) and not Path(path).exists():
        raise ShardError(f"data path {path} does not exist")


RUN_FILES = ("config.toml", "metrics.jsonl", "checkpoints")


def _holds_run(path: Path) -> bool:
    return any((path / name).exists() for name in RUN_FILES)


def _run_dir(cfg: config_mod.TrainConfig, mesh_spec: MeshSpec, resume: bool = False) -> Path:
    """Where this run writes; a run dir that holds another run is reused only with --resume."""
    if cfg.run_dir:
        path = Path(cfg.run_dir)
        if not resume and _holds_run(path):
            saved = path / "config.toml"
            if saved.is_file():
                try:
                    theirs = config_mod.resolve(config_mod.load_file(str(saved)))
                except ShardError:
                    theirs = None
                diff = config_mod.differences(theirs, cfg, ignore=("run_dir",)) if theirs else []
                if diff:
                    key, there, here = diff[0]
                    raise ShardError(f"run dir {path} belongs to a different config ({key} is {there!r} there, "
                                     f"{here!r} here); choose another --run-dir")
            raise ShardError(f"run dir {path} already holds a run; pass --resume to continue it "
                             "or choose another --run-dir")
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{cfg.model.name}-{mesh_spec.source.replace(':', '_').replace('=', '').replace(',', '_')}-{stamp}"
    return path


class ConsoleProgress:
    """Startup summary, a progress bar with loss and tokens/s, and a closing line."""

    def __init__(self, cfg, run_dir: Path):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.cfg, self.run_dir = cfg, run_dir
        self.progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TimeRemainingColumn(), console=console,
        )
        self.task = self.progress.add_task("train", total=cfg.steps, loss="-", tps="-")

    def on_start(self, run) -> None:
        self.progress.update(self.task, completed=run.start_step)
        mesh = ",".join(f"{k}={v}" for k, v in run.mesh.shape.items())
        n_params = self.cfg.model.num_params()
        kind = run.mesh.devices.flat[0].platform
        console.print(f"mesh {mesh} on {run.mesh.size} {kind} device(s) · model {self.cfg.model.name} "
                      f"({n_params / 1e6:.2f}M params) · batch {self.cfg.data.batch}x{self.cfg.data.seq_len} "
                      f"tokens · step compiled in {run.compile_s:.1f}s")
        self.progress.start()

    def on_step(self, step: int) -> None:
        self.progress.update(self.task, completed=step)

    def on_log(self, r: dict) -> None:
        self.progress.update(self.task, loss=f"{r['loss']:.4f}", tps=f"{r['tokens_per_s']:,.0f}")

    def on_end(self, records: list[dict]) -> None:
        self.progress.stop()
        if not records:
            return
        last = records[-1]
        console.print(f"done: {last['step']} steps, loss {records[0]['loss']:.3f} -> {last['loss']:.3f}, "
                      f"{last['tokens_per_s']:,.0f} tokens/s; run dir {self.run_dir}")


@app.command()
def train(
    mesh: MeshOpt = None,
    model: ModelOpt = None,
    steps: Annotated[Optional[int], typer.Option(help="optimizer steps")] = None,
    batch: Annotated[Optional[int], typer.Option(help="global batch, in sequences")] = None,
    seq: Annotated[Optional[int], typer.Option(help="sequence length")] = None,
    data: Annotated[Optional[str], typer.Option(help="text file/folder, .npy/.bin tokens, or 'synthetic'")] = None,
    seed: Annotated[Optional[int], typer.Option(help="seed for init and data order")] = None,
    run_dir: Annotated[Optional[str], typer.Option("--run-dir", help="where config, metrics and checkpoints go")] = None,
    log_every: Annotated[Optional[int], typer.Option("--log-every", help="log every N steps")] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option(
        "--checkpoint-every", help="save a checkpoint every N steps (the last step and preemption always save)")] = None,
    keep: Annotated[Optional[int], typer.Option("--keep", help="keep the newest K checkpoints")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="continue the run in --run-dir from its newest complete checkpoint")] = False,
    allow_fresh: Annotated[bool, typer.Option(
        "--allow-fresh", help="with --resume: start from step 0 when there is no checkpoint yet")] = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    simulate_devices: SimOpt = None,
):
    """Train a model on a device mesh."""
    try:
        base = _resume_base(run_dir) if resume else None
        cfg = config_mod.resolve(_overrides(
            config, set_, base, mesh=mesh, model=model, steps=steps, batch=batch, seq=seq, data=data, seed=seed,
            run_dir=run_dir, simulate_devices=simulate_devices, log_every=log_every,
            checkpoint_every=checkpoint_every, keep=keep))
        mesh_spec = parse_mesh(cfg.mesh.spec)
        _check_data_path(cfg.data.path)
        path = _run_dir(cfg, mesh_spec, resume)
        devices = start_devices(cfg, mesh_spec)
        from shard.checkpoint import CHECKPOINTS_DIR, Checkpoints, SaveCheckpoints
        from shard.loop import prepare
        from shard.loop import train as train_loop
        from shard.metrics import JsonlWriter
        from shard.preemption import StopOnSignal

        def notice(message: str) -> None:
            err_console.print(f"[yellow]{message}[/yellow]", soft_wrap=True)

        checkpoints = Checkpoints(path / CHECKPOINTS_DIR, cfg.checkpoint, notice=notice)
        restore = None
        if resume:
            checkpoints.clean_incomplete()
            if checkpoints.steps():
                restore = checkpoints.restore_latest
            elif not allow_fresh:
                raise ShardError(f"--resume: no complete checkpoint in {checkpoints.directory}; pass "
                                 "--allow-fresh to start this run from step 0")
            else:
                notice(f"no checkpoint in {checkpoints.directory} yet: starting from step 0")
        run = prepare(cfg, devices, restore=restore)
        if run.start_step:
            err_console.print(f"resumed from step {run.start_step} ({checkpoints.path(run.start_step)}), "
                              f"data position {run.stream.position}", soft_wrap=True)
        if run.start_step >= cfg.steps:
            console.print(f"nothing to do: the checkpoint is at step {run.start_step} and --steps is {cfg.steps}")
            return
        path.mkdir(parents=True, exist_ok=True)
        cfg = dataclasses.replace(cfg, run_dir=str(path))
        config_toml = config_mod.to_toml(cfg)
        (path / "config.toml").write_text(config_toml)
        saver = SaveCheckpoints(checkpoints, seed=cfg.seed, config_toml=config_toml)
        stopper = StopOnSignal(notice)
        observers = [ConsoleProgress(cfg, path), JsonlWriter(path / "metrics.jsonl"), saver, stopper]
        train_loop(cfg, run=run, observers=observers)
        checkpoints.close()
        if run.stopped_at is not None:
            console.print(f"stopped by {stopper.received or 'a signal on another process'} after step "
                          f"{run.stopped_at}; checkpoint saved to {checkpoints.path(saver.last_saved)}; "
                          f"continue with: shard train --run-dir {path} --resume", soft_wrap=True)
    except ShardError as e:
        _fail(e)


def _resume_base(run_dir: Optional[str]) -> dict:
    """The config a resumed run starts from: the one saved in its run dir (flags still override it)."""
    if not run_dir:
        raise ShardError("--resume needs --run-dir: the run to continue")
    saved = Path(run_dir) / "config.toml"
    if not Path(run_dir).is_dir():
        raise ShardError(f"--resume: run dir {run_dir} does not exist")
    return config_mod.load_file(str(saved)) if saved.is_file() else {}


@app.command()
def export(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="run dir, its checkpoints/ dir, or one step's dir")],
    out: Annotated[Path, typer.Option("--out", help="new directory for the params-only orbax checkpoint")],
):
    """Write a checkpoint's params only (for inference or fine-tuning), readable by plain orbax."""
    try:
        from shard.checkpoint import export_params

        target, step = export_params(checkpoint, out)
    except ShardError as e:
        _fail(e)
    console.print(f"exported the params of step {step} to {target}")


@app.command()
def inspect(
    mesh: MeshOpt = None,
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the table as JSON")] = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    simulate_devices: SimOpt = None,
):
    """Every parameter's shape, logical axes, PartitionSpec and bytes per device, from shapes alone."""
    try:
        cfg = config_mod.resolve(_overrides(config, set_, mesh=mesh, model=model,
                                            simulate_devices=simulate_devices))
        mesh_spec = parse_mesh(cfg.mesh.spec)
        devices = start_devices(cfg, mesh_spec)
        from shard.inspection import summary
        from shard.loop import make_layout
        from shard.state import state_spec

        layout = make_layout(cfg, mesh_spec, devices)
        doc = summary(state_spec(cfg.model, cfg.optimizer, cfg.steps, layout), layout)
        doc["model"] = cfg.model.name
    except ShardError as e:
        _fail(e)
    if as_json:
        print(json.dumps(doc, indent=1))
        return
    table = Table(title=f"{cfg.model.name} on mesh " + ",".join(f"{k}={v}" for k, v in doc["mesh"].items()))
    for col in ("parameter", "shape", "logical axes", "PartitionSpec", "per device"):
        table.add_column(col, justify="right" if col == "per device" else "left")
    for r in doc["params"]:
        spec = "(" + ", ".join("None" if e is None else str(e) for e in r["partition_spec"]) + ")"
        table.add_row(r["name"], "x".join(map(str, r["shape"])), ", ".join(r["logical_axes"]), spec,
                      _human(r["bytes_per_device"]))
    console.print(table)
    console.print(f"{doc['param_count'] / 1e6:,.2f}M parameters · per device: params "
                  f"{_human(doc['params_bytes_per_device'])}, optimizer state "
                  f"{_human(doc['opt_state_bytes_per_device'])}")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
