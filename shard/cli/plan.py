"""`shard plan`: the layouts of a model on a cluster, ranked by the analytic cost model's step time."""

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from shard.cli.options import PlanSetOpt
from shard import config as config_mod
from shard.config.model import cache_bytes_per_token, cache_line
from shard.errors import ShardError
from shard.observe.console import console, params_phrase, short_bytes, table_console

_MOE_NOT_PLANNED = ("a mixture of experts is planned over data, fsdp and expert axes only: tensor and context "
                    "parallel have no formula for its layers")


def plan(
    model: Annotated[str, typer.Option("--model", help="model preset")] = "llama-13b-24l",
    devices: Annotated[int, typer.Option("--devices", help="accelerators in all")] = 8,
    nodes: Annotated[int, typer.Option("--nodes", help="nodes they sit in (tensor parallel stays inside one)")] = 1,
    hardware: Annotated[str, typer.Option("--hardware", help="h100, h200, h100-pcie, h100-nvl, h200-nvl, a100-40g, a100-80g, cpu, or yours")] = "h100",
    hardware_file: Annotated[Path | None, typer.Option("--hardware-file", help="TOML with more hardware")] = None,
    seq: Annotated[int, typer.Option(help="sequence length")] = 2048,
    batch: Annotated[int | None, typer.Option(help="global batch in sequences (default: 2 per device)")] = None,
    top: Annotated[int, typer.Option(help="rows to print")] = 12,
    as_json: Annotated[bool, typer.Option("--json", help="print every layout as JSON")] = False,
    stages: Annotated[int, typer.Option(help="rank the pipeline schedules for this many stages instead")] = 0,
    microbatches: Annotated[int, typer.Option(help="microbatches per step (with --stages)")] = 8,
    set_: PlanSetOpt = None,
):
    """Rank the layouts of a model on a cluster by predicted step time, from the analytic cost model."""
    from shard import find_hardware, load_hardware
    from shard.measure.plan import REMAT_CHOICES, plan as make_plan

    sets = config_mod.parse_sets(set_ or [])
    if set(sets) - {"model", "optimizer", "precision"}:
        raise ShardError(f"plan takes model.*, optimizer.* and precision.* keys in --set (the rest from its flags: "
                         f"--batch, --seq, ...), got {sorted(set(sets) - {'model', 'optimizer', 'precision'})[0]}.*")
    cfg = config_mod.resolve(config_mod.merge({"model": {"name": model}}, sets))
    hw = find_hardware(hardware, load_hardware(hardware_file))
    if top < 0:
        raise ShardError(f"--top must be 0 or more, got {top}")
    global_batch = 2 * devices if batch is None else batch
    if stages:
        from shard.measure.schedules import rows_per_replica

        return _plan_schedules(cfg.model, stages, microbatches, rows_per_replica(global_batch, devices, stages), seq,
                               hw.name, as_json)
    # A remat policy given with --set is planned alone; the other keys go into the best command.
    remats = (cfg.model.remat,) if "remat" in sets.get("model", {}) else REMAT_CHOICES
    passed_on = tuple(item.strip() for item in set_ or ()
                      if item.partition("=")[0].strip() not in ("model.remat", "model.name"))
    ranked = make_plan(cfg.model, devices, nodes, hw, global_batch, seq, remats, cfg.optimizer.name, cfg.precision)
    best = next((c for c in ranked if c.fits), None)
    best_command = best.command(cfg.model.name, global_batch, seq, passed_on) if best else None
    if as_json:
        _print_json(cfg, hw, {"devices": devices, "nodes": nodes, "batch": global_batch, "seq_len": seq}, best_command,
                    ranked)
        raise typer.Exit(1 if best is None else 0)
    console.print(f"{cfg.model.name} ({params_phrase(cfg.model)}) on {devices} x {hw.name} in "
                  f"{nodes} node(s) · batch {global_batch} x {seq} tokens · {hw.description}")
    _print_table(ranked[:top])
    console.print(f"{sum(c.fits for c in ranked)} of {len(ranked)} layouts fit · * = the axis crosses nodes")
    if cfg.model.n_experts:  # with the table, before the best: that best is not weighed against expert parallel
        console.print(f"warning: {_MOE_NOT_PLANNED}", soft_wrap=True)
    _print_state(cfg, best, hw)
    if best_command:
        console.print(f"best: {best_command}", soft_wrap=True)  # one line to copy
        return
    batch_ways = [c.unsplit_batch_ways for c in ranked]
    if ranked and None not in batch_ways:  # no layout splits the batch, whatever its memory
        fewest = min(batch_ways)
        console.print(f"no layout fits: --batch {global_batch} splits over the data-parallel devices of none "
                      f"of them (the fewest are {fewest}); use a multiple of {fewest}", soft_wrap=True)
    else:
        console.print("no layout fits: add devices, shorten --seq, or lower --batch")
    raise typer.Exit(1)  # like grep with no match: the table is the answer, the status is for scripts


def _print_json(cfg, hw, sizes: dict, best_command: str | None, ranked: list) -> None:
    cache = cache_bytes_per_token(cfg.model, "cpu" if hw.name == "cpu" else "gpu")
    print(json.dumps({"model": cfg.model.name, **sizes, "hardware": hw.name, "best": best_command,
                      "optimizer": cfg.optimizer.name, "precision": cfg.precision,
                      "kv_cache_bytes_per_token": {"held": cache[0], "all_heads": cache[1]},
                      "warnings": [_MOE_NOT_PLANNED] if cfg.model.n_experts else [],
                      "layouts": [c.to_dict() for c in ranked]}, indent=1))


def _print_state(cfg, best, hw) -> None:
    """The best layout's optimizer state per device (beside AdamW's, for another optimizer), and the KV
    cache generation holds per token (MLA's latent beside full keys and values)."""
    from shard.measure.plan import optimizer_state

    if best is not None:
        state = optimizer_state(cfg.model, best, cfg.optimizer.name)
        other = f" (adamw: {short_bytes(state['adamw'])})" if cfg.optimizer.name != "adamw" else ""
        console.print(f"optimizer state per device on {best.mesh_spec()}: {cfg.optimizer.name} "
                      f"{short_bytes(state[cfg.optimizer.name])}{other}", soft_wrap=True)
    console.print(cache_line(cfg.model, "cpu" if hw.name == "cpu" else "gpu") + " (generation)", soft_wrap=True,
                  highlight=False)


def _plan_schedules(model, stages: int, microbatches: int, rows: int, seq: int, hardware: str, as_json: bool) -> None:
    """The schedules for `stages` stages, ranked by bubble (shard.measure.schedules)."""
    from shard.measure.costs import DTYPE_BYTES
    from shard.measure.schedules import schedule_options

    act = DTYPE_BYTES[model.compute_dtype_on("cpu" if hardware == "cpu" else "gpu")]
    options = schedule_options(model, stages, microbatches, rows, seq, act)
    if as_json:
        print(json.dumps({"model": model.name, "stages": stages, "microbatches": microbatches, "schedules": options}))
        return
    table = Table(title=f"{model.name}: {stages} stages x {microbatches} microbatches of {rows // microbatches} rows")
    for col in ("schedule", "V", "ticks", "bubble", "formula", "activations/device", "sends/step"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for r in options:
        table.add_row(r["schedule"], str(r["virtual_stages"]), str(r["ticks"]), f"{r['bubble']:.3f}",
                      f"{r['bubble_formula']:.3f}", short_bytes(r["activation_bytes"]), str(r["sends"]))
    table_console(110).print(table)


def _print_table(candidates: list) -> None:
    columns = ("mesh (pipeline)", "remat", "mem/dev", "comm/step (* crosses nodes)", "step", "serial", "MFU", "fits")
    rows = []
    for c in candidates:
        comm = " ".join(f"{a}{'*' if c.crosses_nodes.get(a) else ''}={short_bytes(b)}" for a, b in c.comm_bytes.items())
        rows.append((c.label(), c.remat, short_bytes(c.memory["total"]), comm or "-", f"{c.step_s:.2f}s",
                     f"{c.step_s_serial:.2f}s", f"{c.mfu:.0%}", "yes" if c.fits else "; ".join(c.problems)))
    table = Table(box=None, pad_edge=False)
    for i, col in enumerate(columns):
        if col == "fits":  # the problems, however long, fold under their column; the figures stay whole
            table.add_column(col, overflow="fold", min_width=12)
        else:
            table.add_column(col, justify="right" if col in ("mem/dev", "step", "serial", "MFU") else "left",
                             no_wrap=True, min_width=max(len(r[i]) for r in [columns, *rows]))
    for row in rows:
        table.add_row(*row)
    table_console(150).print(table)
