"""`shard report`: runs compared, as plots and a table."""

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from shard.observe.console import console, err_console, human_bytes, table_console
from shard.paths import check_outside_checkpoints


def report(
    run_dirs: Annotated[list[str], typer.Argument(help="run directories to compare")],
    out: Annotated[Path | None, typer.Option("--out", help="where the PNGs go, a new or empty folder "
                                                       "(default: report/, or report-2/, ...; with --json, only when given)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the table as JSON")] = False,
):
    """Plots of loss and throughput (runs overlaid, resumes and resizes marked) and a table of the runs.

    The table: model, layout, final loss, tokens/s, MFU, memory, where each run resumed; for a run that
    shard launch ran, its resizes, the steps they redid and its goodput (time training / time held). An
    earlier report is never written over: a given --out must be new or empty, and without one the report
    goes to report/ or the first free report-N/."""
    from shard.observe.report import check_empty_out, fresh_folder
    from shard.observe.report import report as make_report

    if out is not None:
        check_outside_checkpoints(out)
        check_empty_out(out)
    elif not as_json:  # --json alone: stdout only
        out = fresh_folder(Path("report"))
    doc = make_report(run_dirs, out)
    if as_json:
        print(json.dumps(doc, indent=1))
        return
    _print_table(doc)
    for r in doc["runs"]:
        if r["skipped_lines"]:
            err_console.print(f"[yellow]{escape(r['run'])}: skipped {r['skipped_lines']} line(s) of metrics.jsonl that "
                              "are not complete records (a run killed mid-write?)[/yellow]", soft_wrap=True)
        if r["config_problem"]:
            err_console.print(f"[yellow]{escape(r['run'])}: {escape(r['config_problem'])}, so its model and layout "
                              "are shown as ?[/yellow]", soft_wrap=True)
    console.print("plots: " + ", ".join(doc["plots"]), soft_wrap=True)


def _print_table(doc: dict) -> None:
    table = Table(title="runs")
    launched = any(r["resizes"] is not None for r in doc["runs"])  # shard launch's columns, where a run has its events
    for col in ("run", "model", "layout", "steps", "final loss", "median tokens/s", "MFU", "peak memory/device",
                "resumed at") + (("resizes", "steps redone", "goodput") if launched else ()):
        table.add_column(col, overflow="fold")  # run paths whole, never "/tmp/ru…"
    for r in doc["runs"]:
        mem = human_bytes(r["peak_memory_bytes"]) + (" (compiled)" if r["memory_source"] == "compiled" else "") \
            if r["peak_memory_bytes"] is not None else "-"
        loss = "-" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        resumed = ", ".join(f"{x['step']}" + (f" (on {x['mesh']})" if x["layout_changed"] else "")
                            for x in r["resumes"]) or "-"
        elastic = ("-" if r["resizes"] is None else str(len(r["resizes"])),
                   "-" if r["steps_redone"] is None else str(r["steps_redone"]),
                   "-" if r["goodput"] is None else f"{r['goodput']:.1%}")
        table.add_row(r["run"], r["model"], r["layout"], str(r["steps"]), loss, f"{r['median_tokens_per_s']:,.0f}",
                      "-" if r["mfu"] is None else f"{r['mfu']:.1%}", mem, resumed, *(elastic if launched else ()))
    # at least 120 columns, as plan's table: in 80 a column's heading shrank to "e"; paths are not markup
    table_console(140 if launched else 120).print(table)
