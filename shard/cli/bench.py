"""`shard bench`: measure the machine; `bench collectives` times each collective over each mesh axis."""

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from shard.cli.options import MeshOpt, SimOpt, overrides, start_devices
from shard import build_mesh, parse_mesh
from shard import config as config_mod
from shard.errors import ShardError
from shard.observe.console import console, err_console, human_bytes

bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Measure the machine.")


@bench_app.command("collectives")
def bench_collectives(
    mesh: MeshOpt = None,
    min_size: Annotated[int, typer.Option("--min-size", help="smallest message, bytes")] = 1024,
    max_size: Annotated[int, typer.Option("--max-size", help="largest message, bytes")] = 64 * 1024 * 1024,
    iters: Annotated[int, typer.Option(help="timed runs per point (median)")] = 5,
    kinds: Annotated[list[str] | None, typer.Option("--kind", help="only these collectives")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON lines")] = False,
    simulate_devices: SimOpt = None,
):
    """All-reduce, all-gather, reduce-scatter, all-to-all and permute over each mesh axis: time,
    algorithm bandwidth and bus bandwidth as nccl-tests computes them."""
    from shard.measure.hlo import KINDS

    cfg = config_mod.resolve(overrides({}, None, mesh=mesh, simulate_devices=simulate_devices))
    mesh_spec = parse_mesh(cfg.mesh.spec)
    for k in kinds or ():
        if k not in KINDS:
            raise ShardError(f"unknown collective {k!r} (known: {', '.join(KINDS)})")
    if min_size <= 0 or max_size < min_size:
        raise ShardError("--min-size must be positive and at most --max-size")
    if iters <= 0:
        raise ShardError(f"--iters must be positive, got {iters}")
    if all(n == 1 for n in mesh_spec.shape):  # from the flag alone (a -1 size may fill several devices)
        raise ShardError(f"mesh {mesh_spec.describe()} has no axis of size > 1: nothing to measure; give a mesh "
                         "with one, e.g. --mesh 8x1")
    devices = start_devices(cfg, mesh_spec)
    from shard.measure.bench import bench, sizes_between

    jmesh = build_mesh(mesh_spec, devices)
    show = _Results(as_json)
    if not bench(jmesh, sizes_between(min_size, max_size), tuple(kinds or KINDS), iters, on_result=show):
        raise ShardError(f"mesh {mesh_spec.describe(tuple(jmesh.shape.values()))} has no axis of size > 1 on "
                         f"{len(devices)} device(s): nothing to measure")
    show.print_table()


class _Results:
    """Each result as it comes: a JSON line, or a table row printed at the end."""

    def __init__(self, as_json: bool):
        self.as_json, self.noted = as_json, False
        self.table = None
        if not as_json:
            self.table = Table(title="collectives (nccl-tests conventions; GB/s = 1e9 B/s)")
            for col in ("collective", "axis", "n", "size", "time", "algbw GB/s", "busbw GB/s"):
                self.table.add_column(col, justify="left" if col in ("collective", "axis") else "right")

    def __call__(self, r: dict) -> None:
        if r["size_bytes"] != r["asked_bytes"] and not self.noted:  # whole float32s, at least one per device
            self.noted = True
            err_console.print(f"[yellow]sizes are rounded to whole float32 elements, at least one per device of "
                              f"the axis: {human_bytes(r['asked_bytes'])} asked, {human_bytes(r['size_bytes'])} "
                              f"measured ({r['kind']} over {r['axis']})[/yellow]", soft_wrap=True)
        if self.as_json:
            print(json.dumps(r), flush=True)
        else:
            self.table.add_row(r["kind"], r["axis"], str(r["devices"]), human_bytes(r["size_bytes"]),
                               f"{r['time_us']:.1f}us", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}")

    def print_table(self) -> None:
        if self.table is not None:
            Console(highlight=False, emoji=False, markup=False, width=max(console.width, 110)).print(self.table)
