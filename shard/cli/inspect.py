"""`shard inspect`: every parameter's layout from shapes alone, and with --compiled what the compiled
step moves and holds."""

import json
from typing import Annotated

import typer
from rich.table import Table

from shard.cli.options import ConfigOpt, MeshOpt, ModelOpt, SetOpt, SimOpt, config_file, overrides, start_devices
from shard import config as config_mod
from shard import parse_mesh
from shard.observe.console import console, human_bytes, param_count, table_console


def inspect(
    mesh: MeshOpt = None,
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the table as JSON")] = False,
    compiled: Annotated[bool, typer.Option("--compiled", help="also compile the train step (from shapes) and "
                                           "report its collectives, communication efficiency and memory")] = False,
    batch: Annotated[int | None, typer.Option(help="global batch, in sequences (with --compiled)")] = None,
    seq: Annotated[int | None, typer.Option(help="sequence length (with --compiled)")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    simulate_devices: SimOpt = None,
):
    """Every parameter's shape, logical axes, PartitionSpec and bytes per device, from shapes alone."""
    cfg = config_mod.resolve(overrides(config_file(config), set_, mesh=mesh, model=model, batch=batch, seq=seq,
                                       simulate_devices=simulate_devices))
    devices = start_devices(cfg, parse_mesh(cfg.mesh.spec))
    from shard.measure.inspection import inspect_config

    doc = inspect_config(cfg, devices, compiled)
    if as_json:
        print(json.dumps(doc, indent=1))
        return
    _print_params(doc, cfg.model.name)
    if "pipeline" in doc:
        _print_schedule(doc["pipeline"])
    if compiled:
        _print_compiled(doc)


def _print_params(doc: dict, model: str) -> None:
    table = Table(title=f"{model} on mesh " + ",".join(f"{k}={v}" for k, v in doc["mesh"].items()))
    for col in ("parameter", "shape", "logical axes", "PartitionSpec", "per device"):
        table.add_column(col, justify="right" if col == "per device" else "left")
    for r in doc["params"]:
        spec = "(" + ", ".join("None" if e is None else e if isinstance(e, str) else "(" + ", ".join(e) + ")"
                               for e in r["partition_spec"]) + ")"
        table.add_row(r["name"], "x".join(map(str, r["shape"])), ", ".join(a or "-" for a in r["logical_axes"]), spec,
                      human_bytes(r["bytes_per_device"]))
    table_console().print(table)
    padding = f" + {doc['vocab_padding']:,} vocab padding" if doc["vocab_padding"] else ""
    console.print(f"{param_count(doc['param_count'])} parameters{padding} · per device: params "
                  f"{human_bytes(doc['params_bytes_per_device'])}, optimizer state "
                  f"{human_bytes(doc['opt_state_bytes_per_device'])}", soft_wrap=True)


def _print_schedule(p: dict) -> None:
    console.print(f"pipeline {p['schedule']}: {p['stages']} stages x {p['microbatches']} microbatches"
                  + (f" x {p['virtual_stages']} virtual stages" if p["virtual_stages"] > 1 else "")
                  + f", {p['ticks']} ticks, bubble {p['bubble_schedule']:.3f} (formula {p['bubble_formula']:.3f}), "
                  f"inputs held per stage {p['held']} (F forward, B backward, W weight gradient, . idle)",
                  soft_wrap=True)
    console.print(p["chart"], soft_wrap=True, markup=False, highlight=False)


def _print_compiled(doc: dict) -> None:
    table = Table(title=f"collectives per step (batch {doc['batch']}x{doc['seq_len']}, {doc['platform']})")
    for col in ("kind", "mesh axes", "compiled as", "count", "bytes/device", "as compiled"):
        table.add_column(col, justify="right" if col in ("count", "bytes/device", "as compiled") else "left")
    bounded = {a for r in doc["collectives"] if r["upper_bound"] for a in r["axes"]}  # see the "<=" note below
    for r in doc["collectives"]:
        table.add_row(r["kind"], "+".join(r["axes"]), r["compiled_as"], f"{'<=' if r['upper_bound'] else ''}{r['count']}",
                      human_bytes(r["bytes_per_device"]), human_bytes(r["compiled_bytes_per_device"]))
    table_console(110).print(table)
    if bounded:
        console.print("<=: an upper bound: in a conditional's branches (the 1F1B schedule's switch), counted as if "
                      "every branch ran on every call, or a ragged all-to-all counted by its receive buffer (it "
                      "sends only the rows routed)", soft_wrap=True)
    moved = lambda axis: ("at most " if axis in bounded else "") + human_bytes(doc["bytes_per_axis"].get(axis, 0))  # noqa: E731
    for axis, eff in doc["communication_efficiency"].items():
        console.print(f"axis {axis}: moved {moved(axis)}, analytic minimum "
                      f"{human_bytes(doc['minimum_bytes_per_axis'].get(axis, 0))}, efficiency {eff:.3f}"
                      + (" (a lower bound)" if axis in bounded else ""), soft_wrap=True)
    for axis, parallelism in doc["unmodelled_axes"].items():
        console.print(f"axis {axis}: moved {moved(axis)}, no analytic minimum ({parallelism} has no formula yet)",
                      soft_wrap=True)
    m = doc["memory"]
    console.print(f"memory per device {human_bytes(m['total'])} (arguments {human_bytes(m['arguments'])} + temporaries "
                  f"{human_bytes(m['temporaries'])} + outputs {human_bytes(m['outputs'])} - aliased {human_bytes(m['aliased'])}) · "
                  f"model FLOPs/device {doc['model_flops_per_device']:.3g}"
                  + (f", the compiled step's matmuls {doc['matmul_flops_per_device']:.3g} (each loop by its trip "
                     "count, remat's recompute included; " if doc["matmul_flops_per_device"] is not None else " (")
                  + f"XLA's cost analysis: {doc['flops_per_device']:.3g}, counting each loop body once, so one "
                  "scanned layer)", soft_wrap=True)
