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
from shard import profiling
from shard.errors import ShardError
from shard.mesh import MeshSpec, devices_needed, parse_mesh

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train Transformers on any device mesh: the parallel layout is data, not code.")
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

DEFAULT_FILL_DEVICES = 8

# Options shared by the commands that build a mesh and a model.
MeshOpt = Annotated[Optional[str], typer.Option("--mesh", help="8x4 | data=2,fsdp=2,model=2 | preset (meshes/) | preset:4x2")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", help="model preset: tiny, small, moe-tiny, llama-1b, llama-7b, ...")]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="TOML config file")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="override a config key: --set optimizer.lr=3e-4")]
SimOpt = Annotated[Optional[int], typer.Option("--simulate-devices", help="CPU devices to simulate (default: what the mesh needs, 8 to fill)")]


def _overrides(config: Optional[Path], sets: Optional[list[str]], **flags) -> dict:
    """defaults < config file < flags < --set, as one nested override dict."""
    flag_keys = {"mesh": "mesh.spec", "model": "model.name", "steps": "steps", "batch": "data.batch",
                 "seq": "data.seq_len", "data": "data.path", "seed": "seed", "run_dir": "run_dir",
                 "simulate_devices": "mesh.simulate_devices", "log_every": "log_every",
                 "compile_cache": "xla.compile_cache"}
    out = config_mod.load_file(str(config)) if config else {}
    flat = {flag_keys[k]: v for k, v in flags.items() if v is not None}
    out = config_mod.merge(out, config_mod.parse_sets([f"{k}={json.dumps(v)}" for k, v in flat.items()]))
    return config_mod.merge(out, config_mod.parse_sets(sets or []))


def start_devices(cfg: config_mod.TrainConfig, mesh_spec: MeshSpec, compile_cache: Path | None = None):
    """Settle XLA flags and the CPU device count, start JAX, and return the devices the mesh will use."""
    from shard import xla_flags
    from shard.devices import jax_started, request_host_devices

    if not jax_started():
        xla_flags.apply(gpu_preset=cfg.xla.gpu_flags, deterministic=cfg.xla.deterministic)
    wanted = cfg.mesh.simulate_devices or devices_needed(mesh_spec, DEFAULT_FILL_DEVICES)
    asked = request_host_devices(wanted)
    import jax

    if compile_cache is not None and not jax.config.jax_compilation_cache_dir:
        compile_cache.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(compile_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
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


def _compile_cache(cfg: config_mod.TrainConfig, run_dir: Path) -> Path | None:
    """`auto`: one cache beside the run dirs, so a restart or the next run does not recompile."""
    if cfg.xla.compile_cache in ("", "none"):
        return None
    return run_dir.parent / ".compile_cache" if cfg.xla.compile_cache == "auto" else Path(cfg.xla.compile_cache)


def _run_dir(cfg: config_mod.TrainConfig, mesh_spec: MeshSpec) -> Path:
    if cfg.run_dir:
        path = Path(cfg.run_dir)
        if (path / "metrics.jsonl").exists():
            raise ShardError(f"run dir {path} already holds a run; choose another --run-dir")
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
        import jax

        cfg = self.cfg
        mesh = ",".join(f"{k}={v}" for k, v in run.mesh.shape.items())
        kind = run.mesh.devices.flat[0].platform
        hosts = jax.process_count()
        peak = run.compiled_memory.get("peak")
        console.print(
            f"mesh {mesh} on {run.mesh.size} {kind} device(s)"
            + (f" ({run.mesh.size // hosts} per host x {hosts} hosts)" if hosts > 1 else "")
            + f" · model {cfg.model.name} ({cfg.model.num_params() / 1e6:.2f}M params)"
            + f" · global batch {cfg.data.batch}x{cfg.data.seq_len} = {cfg.data.batch * cfg.data.seq_len:,} tokens"
            + (f" · pipeline {p['schedule']}, {p['stages']} stages x {p['microbatches']} microbatches, "
               f"bubble {p['bubble']:.1%}" if (p := run.pipeline) else "")
            + (f" · ~{_human(peak)} per device (compiled estimate)" if peak else "")
            + f" · step compiled in {run.compile_s:.1f}s", soft_wrap=True)
        self.progress.start()

    def on_step(self, step: int, outputs=None) -> None:
        self.progress.update(self.task, completed=step)

    def on_log(self, r: dict) -> None:
        self.progress.update(self.task, loss=f"{r['loss']:.4f}", tps=f"{r['tokens_per_s']:,.0f}")

    def on_end(self, records: list[dict]) -> None:
        self.progress.stop()
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
    run_dir: Annotated[Optional[str], typer.Option("--run-dir", help="where config and metrics go")] = None,
    log_every: Annotated[Optional[int], typer.Option("--log-every", help="log every N steps")] = None,
    profile_steps: Annotated[Optional[str], typer.Option(
        "--profile-steps", help="A:B: profile steps A to B into RUN_DIR/profile and summarise them")] = None,
    compile_cache: Annotated[Optional[str], typer.Option(
        "--compile-cache", help="persistent compilation cache dir (default: beside the run dir; 'none': off)")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    simulate_devices: SimOpt = None,
):
    """Train a model on a device mesh."""
    try:
        cfg = config_mod.resolve(_overrides(
            config, set_, mesh=mesh, model=model, steps=steps, batch=batch, seq=seq, data=data, seed=seed,
            run_dir=run_dir, simulate_devices=simulate_devices, log_every=log_every, compile_cache=compile_cache))
        mesh_spec = parse_mesh(cfg.mesh.spec)
        _check_data_path(cfg.data.path)
        window = profiling.parse_window(profile_steps, cfg.steps) if profile_steps else None
        path = _run_dir(cfg, mesh_spec)
        devices = start_devices(cfg, mesh_spec, _compile_cache(cfg, path))
        from shard.loop import prepare
        from shard.loop import train as train_loop
        from shard.metrics import JsonlWriter, TensorBoardWriter

        run = prepare(cfg, devices)
        path.mkdir(parents=True, exist_ok=True)
        cfg = dataclasses.replace(cfg, run_dir=str(path))
        (path / "config.toml").write_text(config_mod.to_toml(cfg))
        observers = [ConsoleProgress(cfg, path), JsonlWriter(path / "metrics.jsonl"), TensorBoardWriter(path / "tb")]
        if window:
            observers.append(profiler := profiling.Profiler(*window, path / "profile"))
        train_loop(cfg, run=run, observers=observers)
        if window and profiler.summary:
            console.print(profiling.format_summary(profiler.summary), soft_wrap=True)
    except ShardError as e:
        _fail(e)


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
        table.add_row(r["name"], "x".join(map(str, r["shape"])), ", ".join(a or "-" for a in r["logical_axes"]), spec,
                      _human(r["bytes_per_device"]))
    console.print(table)
    console.print(f"{doc['param_count'] / 1e6:,.2f}M parameters · per device: params "
                  f"{_human(doc['params_bytes_per_device'])}, optimizer state "
                  f"{_human(doc['opt_state_bytes_per_device'])}")


@app.command()
def report(
    run_dirs: Annotated[list[str], typer.Argument(help="run directories to compare")],
    out: Annotated[Optional[Path], typer.Option("--out", help="where the PNGs go (default: report/)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the table as JSON")] = False,
):
    """Plots of loss and throughput (runs overlaid) and a table: layout, final loss, tokens/s, MFU, memory."""
    from shard.report import report as make_report

    try:
        doc = make_report(run_dirs, out or Path("report"))
    except ShardError as e:
        _fail(e)
    if as_json:
        print(json.dumps(doc, indent=1))
        return
    table = Table(title="runs")
    for col in ("run", "layout", "steps", "final loss", "median tokens/s", "MFU", "peak memory/device"):
        table.add_column(col)
    for r in doc["runs"]:
        mem = _human(r["peak_memory_bytes"]) + (" (compiled)" if r["memory_source"] == "compiled" else "") \
            if r["peak_memory_bytes"] is not None else "-"
        table.add_row(r["run"], r["layout"], str(r["steps"]), f"{r['final_loss']:.4f}",
                      f"{r['median_tokens_per_s']:,.0f}", "-" if r["mfu"] is None else f"{r['mfu']:.1%}", mem)
    console.print(table)
    console.print("plots: " + ", ".join(doc["plots"]), soft_wrap=True)


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
