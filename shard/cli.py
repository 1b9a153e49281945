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
SimOpt = Annotated[Optional[int], typer.Option("--simulate-devices", help="CPU devices to simulate in each process (default: what the mesh needs, 8 to fill)")]


def _overrides(config: Optional[Path], sets: Optional[list[str]], **flags) -> dict:
    """defaults < config file < flags < --set, as one nested override dict."""
    flag_keys = {"mesh": "mesh.spec", "model": "model.name", "steps": "steps", "batch": "data.batch",
                 "seq": "data.seq_len", "data": "data.path", "seed": "seed", "run_dir": "run_dir",
                 "simulate_devices": "mesh.simulate_devices", "log_every": "log_every",
                 "cross_host": "cluster.cross_host", "failure_timeout": "cluster.failure_timeout",
                 "eval_every": "eval.every"}
    out = config_mod.load_file(str(config)) if config else {}
    flat = {flag_keys[k]: v for k, v in flags.items() if v is not None}
    out = config_mod.merge(out, config_mod.parse_sets([f"{k}={json.dumps(v)}" for k, v in flat.items()]))
    return config_mod.merge(out, config_mod.parse_sets(sets or []))


def start_devices(cfg: config_mod.TrainConfig, mesh_spec: MeshSpec, cluster=None):
    """Settle the CPU device count (per process), join the cluster if there is one, start JAX, and
    return the devices the mesh will use (every process's with --cross-host xla, this one's with mpi)."""
    from shard import distributed
    from shard.devices import request_host_devices

    n_proc = cluster.num_processes if cluster else 1
    needed = devices_needed(mesh_spec, DEFAULT_FILL_DEVICES * n_proc)
    if not cfg.mesh.simulate_devices and needed % n_proc:
        raise ShardError(f"mesh {mesh_spec.describe()} needs {needed} devices, which do not split evenly "
                         f"over {n_proc} processes")
    wanted = cfg.mesh.simulate_devices or needed // n_proc
    asked = request_host_devices(wanted)
    ctx = distributed.start(cluster, cfg.cluster.cross_host, cfg.cluster.failure_timeout)
    import jax

    devices = jax.devices() if ctx.mode != distributed.MPI else jax.local_devices()
    if asked and devices[0].platform == "cpu" and wanted > 1 and ctx.is_main:
        each = f" in each of {n_proc} processes" if n_proc > 1 else ""
        err_console.print(f"[dim]simulating {wanted} CPU devices{each} (XLA host platform); "
                          "set --simulate-devices to change[/dim]")
    return devices


def _fail(e: Exception):
    err_console.print(f"[red]error:[/red] {e}", soft_wrap=True)
    raise typer.Exit(2)


def _check_data_path(path: str) -> None:
    from shard.data import EMBEDDED, SYNTHETIC

    if path not in (EMBEDDED, SYNTHETIC) and not Path(path).exists():
        raise ShardError(f"data path {path} does not exist")


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
        mesh = ",".join(f"{k}={v}" for k, v in run.mesh.shape.items())
        n_params = self.cfg.model.num_params()
        kind = run.mesh.devices.flat[0].platform
        from shard import distributed

        ctx = distributed.context()
        where = f"{run.mesh.size} {kind} device(s)"
        if ctx.mode == distributed.XLA:
            where += f" in {ctx.size} processes"
        elif ctx.mode == distributed.MPI:
            where = f"{run.mesh.size} {kind} device(s) in each of {ctx.size} processes (MPI bridge)"
        compiled = "on the first step" if run.compile_s is None else f"in {run.compile_s:.1f}s"
        console.print(f"mesh {mesh} on {where} · model {self.cfg.model.name} "
                      f"({n_params / 1e6:.2f}M params) · batch {self.cfg.data.batch}x{self.cfg.data.seq_len} "
                      f"tokens · step compiled {compiled}")
        self.progress.start()

    def on_step(self, step: int) -> None:
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
    config: ConfigOpt = None,
    set_: SetOpt = None,
    simulate_devices: SimOpt = None,
    coordinator: Annotated[Optional[str], typer.Option(help="HOST:PORT of process 0, to start processes by hand (with --num-processes, --process-id)")] = None,
    num_processes: Annotated[Optional[int], typer.Option("--num-processes", help="processes in the job (explicit form)")] = None,
    process_id: Annotated[Optional[int], typer.Option("--process-id", help="this process's id, 0..N-1 (explicit form)")] = None,
    cross_host: Annotated[Optional[str], typer.Option("--cross-host", help="xla: one global mesh (default) | mpi: local meshes + MPI all-reduce")] = None,
    failure_timeout: Annotated[Optional[float], typer.Option("--failure-timeout", help="seconds before a silent process counts as lost (default 60)")] = None,
    eval_every: Annotated[Optional[int], typer.Option("--eval-every", help="held-out loss every N steps, on the eval.processes first processes")] = None,
):
    """Train a model on a device mesh; under mpiexec or srun, on every process of the job."""
    import os

    from shard import distributed

    try:
        cfg = config_mod.resolve(_overrides(
            config, set_, mesh=mesh, model=model, steps=steps, batch=batch, seq=seq, data=data, seed=seed,
            run_dir=run_dir, simulate_devices=simulate_devices, log_every=log_every, cross_host=cross_host,
            failure_timeout=failure_timeout, eval_every=eval_every))
        cluster = distributed.plan(os.environ, coordinator, num_processes, process_id)
        mesh_spec = parse_mesh(cfg.mesh.spec)
        _check_data_path(cfg.data.path)
        main = cluster is None or cluster.process_id == 0
        path = _run_dir(cfg, mesh_spec) if main else None
        devices = start_devices(cfg, mesh_spec, cluster)
        from shard.loop import prepare
        from shard.loop import train as train_loop
        from shard.metrics import JsonlWriter

        try:
            run = prepare(cfg, devices)
            observers = []
            if distributed.context().is_main:  # only process 0 prints and writes the run's files
                path.mkdir(parents=True, exist_ok=True)
                cfg = dataclasses.replace(cfg, run_dir=str(path))
                (path / "config.toml").write_text(config_mod.to_toml(cfg))
                observers = [ConsoleProgress(cfg, path), JsonlWriter(path / "metrics.jsonl")]
            train_loop(cfg, run=run, observers=observers)
        except ShardError:
            raise
        except Exception as e:  # noqa: BLE001 - a lost peer surfaces as a runtime error in a collective
            distributed.fail(e)  # several processes: names the lost one and exits; one process: re-raises
        distributed.finish()
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
