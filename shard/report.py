"""`shard report RUN_DIR ...`: loss and throughput plots of several runs overlaid, and a summary table."""

import statistics
import tomllib
from pathlib import Path

from shard.errors import ShardError
from shard.metrics import read_records

RECORD_FIELDS = {"step", "loss", "time_s", "tokens_per_s"}  # what the table and plots read


def load_run(run_dir: str) -> dict:
    path = Path(run_dir)
    metrics, config = path / "metrics.jsonl", path / "config.toml"
    if not metrics.is_file():
        raise ShardError(f"{run_dir} is not a run directory: no metrics.jsonl")
    records, skipped = read_records(metrics)
    complete = [r for r in records if set(r) >= RECORD_FIELDS]
    skipped += len(records) - len(complete)
    if not complete:
        raise ShardError(f"{run_dir}: metrics.jsonl holds no complete record"
                         + (f" ({skipped} unreadable line(s))" if skipped else ""))
    try:
        cfg = tomllib.loads(config.read_text()) if config.is_file() else {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        cfg = {}  # the layout is then shown as "?"
    model = cfg.get("model", {}).get("name", "?")
    mesh = cfg.get("mesh", {}).get("spec", "?")
    return {"dir": str(path), "name": f"{model} {mesh} ({path.name})", "model": model, "layout": mesh,
            "records": complete, "skipped_lines": skipped}


def summary_row(run: dict) -> dict:
    recs = run["records"]
    tps = [r["tokens_per_s"] for r in recs[1:]] or [recs[0]["tokens_per_s"]]  # first interval warms up
    mfu = [r["mfu"] for r in recs if r.get("mfu") is not None]
    peaks = [r["mem_peak_bytes"] for r in recs if "mem_peak_bytes" in r]
    return {
        "run": run["dir"], "model": run["model"], "layout": run["layout"], "steps": recs[-1]["step"],
        "final_loss": recs[-1]["loss"], "median_tokens_per_s": statistics.median(tps),
        "mfu": statistics.median(mfu) if mfu else None, "peak_memory_bytes": max(peaks) if peaks else None,
        "memory_source": recs[-1].get("mem_source"), "skipped_lines": run["skipped_lines"],
    }


def plot(runs: list[dict], out: Path) -> list[Path]:
    """loss vs step, loss vs time, tokens/s vs step: one PNG each, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if out.exists() and not out.is_dir():
        raise ShardError(f"--out {out} is a file; give a folder for the plots")
    out.mkdir(parents=True, exist_ok=True)
    charts = [("loss_vs_step.png", "step", "loss"), ("loss_vs_time.png", "time_s", "loss"),
              ("throughput_vs_step.png", "step", "tokens_per_s")]
    paths = []
    for name, x, y in charts:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for run in runs:
            recs = run["records"]
            ax.plot([r[x] for r in recs], [r[y] for r in recs], marker=".", label=run["name"])
        ax.set_xlabel({"time_s": "time (s)"}.get(x, x))
        ax.set_ylabel({"tokens_per_s": "tokens/s"}.get(y, y))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def report(run_dirs: list[str], out: Path) -> dict:
    runs = [load_run(d) for d in run_dirs]
    pngs = plot(runs, out)
    return {"runs": [summary_row(r) for r in runs], "plots": [str(p) for p in pngs]}
