"""`shard report RUN_DIR ...`: loss and throughput plots of several runs overlaid, and a summary table."""

import statistics
import tomllib
from pathlib import Path

from shard.errors import ShardError
from shard.sharding.mesh import rename_mesh_file
from shard.observe.metrics import is_event, read_lines

RECORD_FIELDS = {"step", "loss", "time_s", "tokens_per_s"}  # what the table and plots read


def load_run(run_dir: str) -> dict:
    path = Path(run_dir)
    metrics, config = path / "metrics.jsonl", path / "config.toml"
    if not metrics.is_file():
        raise ShardError(f"{run_dir} is not a run directory: no metrics.jsonl")
    lines, skipped = read_lines(metrics)  # step records and shard launch's events, in the order written
    records = [r for r in lines if not is_event(r)]
    complete = [r for r in records if set(r) >= RECORD_FIELDS]
    skipped += len(records) - len(complete)
    if not complete:
        raise ShardError(f"{run_dir}: metrics.jsonl holds no complete record"
                         + (f" ({skipped} unreadable line(s))" if skipped else ""))
    config_problem = None if config.is_file() else "no config.toml"
    try:
        cfg = tomllib.loads(config.read_text()) if config.is_file() else {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        cfg, config_problem = {}, f"config.toml is not valid TOML ({e})"
    if not isinstance(cfg.get("model", {}), dict) or not isinstance(cfg.get("mesh", {}), dict):
        cfg, config_problem = {}, "config.toml's [model] or [mesh] is not a table"
    model = cfg.get("model", {}).get("name", "?")
    # a mesh file is saved absolute: its name says enough
    mesh = rename_mesh_file(str(cfg.get("mesh", {}).get("spec", "?")), lambda path: path.name)
    trained, latest_start = as_trained(complete)
    ran_on = list(dict.fromkeys(r["mesh"] for r in trained if isinstance(r.get("mesh"), str)))
    # the legend names every layout the kept steps ran on (the config holds the last one only)
    legend = " → ".join(ran_on) if len(ran_on) > 1 else mesh
    return {"dir": str(path), "name": f"{model} {legend} ({path.name})", "model": model, "layout": mesh,
            "records": trained, "latest_start": latest_start, "resumes": resumes(complete, trained),
            "launch": launch_summary([x for x in lines if is_event(x) or set(x) >= RECORD_FIELDS]),
            "skipped_lines": skipped,
            "config_problem": config_problem}  # the model and layout are then shown as "?"


def as_trained(records: list[dict]) -> tuple[list[dict], int]:
    """The records of a run as it trained, and the first step of its latest start.

    Each start (a resume, perhaps on another mesh) appends to metrics.jsonl with its clock at 0 and
    repeats the steps after the checkpoint it resumed from: the last record of a step is the one that
    counts, and the steps an earlier start logged past it are dropped (that start was abandoned), so a
    resumed run read while it trains shows no records of the start it replaced. `time_s` is made to run
    on across starts. A start is known by its records' `start_step`; in files written before that
    field, by its clock or steps going back."""
    by_step: dict[int, dict] = {}
    offset, last = 0.0, None
    latest = records[0]["step"]
    for r in records:
        if _new_start(last, r):
            offset, latest = by_step[last["step"]]["time_s"], r["step"]
            cut = r.get("start_step", r["step"] - 1)  # the checkpoint it resumed from
            by_step = {s: rec for s, rec in by_step.items() if s <= cut}
        by_step[r["step"]] = {**r, "time_s": r["time_s"] + offset}
        last = r
    return [by_step[s] for s in sorted(by_step)], latest


def _new_start(last: dict | None, r: dict) -> bool:
    """Whether record `r` begins another start of the run than `last`, the record before it."""
    return last is not None and (r.get("start_step") != last.get("start_step") or r["time_s"] < last["time_s"]
                                 or r["step"] <= last["step"])


def resumes(records: list[dict], trained: list[dict]) -> list[dict]:
    """Where a run resumed, among the starts that count (as_trained): the step each such start resumed
    from (its records' start_step; in files written before that field, the first step it logged), its
    mesh (records carry it since shard wrote `mesh`; None before) and whether that mesh differs from the
    start before."""
    out, last, mesh = [], None, None
    for r in records:
        if _new_start(last, r):
            out.append({"first": r["step"], "step": r.get("start_step", r["step"]), "mesh": r.get("mesh"),
                        "layout_changed": r.get("mesh") is not None and mesh is not None and r.get("mesh") != mesh})
        mesh, last = r.get("mesh", mesh), r
    steps = {r["step"] for r in trained}
    counted = [x for x in out if x["first"] in steps]
    # a start that a later one replaced (the later one resumed from before it) left nothing to mark
    return [{k: v for k, v in x.items() if k != "first"} for i, x in enumerate(counted)
            if all(y["first"] > x["first"] for y in counted[i + 1:])]


def launch_summary(lines: list[dict]) -> dict | None:
    """What `shard launch`'s events say of a run (None when it has none): its resizes, the steps they
    redid, and its goodput (time_training_s / time_held_s; None until a launch has ended).

    `lines` are the run's events and complete step records in the order written. Time held is that of
    each launch that ended: launch_end's held_s (else its time less launch_start's). Time training is the
    time its kept steps took: each step as_trained keeps counts once, at the step_time_s of the record
    that logged it (a record stands for the steps since the one before it in its start, or since the
    checkpoint its start resumed from); only the steps logged between a launch's start and end count,
    and steps a later start trained again (redone) count only as that start trained them."""
    events = [x for x in lines if is_event(x)]
    if not events:
        return None
    resizes = [{k: v for k, v in e.items() if k != "event"} for e in events if e["event"] == "resize"]
    held, training = _held_and_training(lines)
    return {"resizes": resizes, "steps_redone": sum(r.get("steps_redone", 0) for r in resizes),
            "time_held_s": held, "time_training_s": training,
            "goodput": training / held if held and training is not None else None}


def _held_and_training(lines: list[dict]) -> tuple[float | None, float | None]:
    """The seconds held by the launches that ended, and the seconds their kept steps took (launch_summary);
    (None, None) when no launch ended, a time None where a step record lacks step_time_s."""
    # (first step, last step, seconds a step, the launch it was logged in): the steps each record stands for
    spans: list[tuple[int, int, float | None, int | None]] = []
    held: dict[int, float] = {}
    launch, began, launches, last = None, 0.0, 0, None
    for x in lines:
        if is_event(x):
            if x["event"] == "launch_start":
                launch, began, launches = launches, x["time"], launches + 1
            elif x["event"] == "launch_end" and launch is not None:
                held[launch], launch = x.get("held_s", x["time"] - began), None
            continue
        if _new_start(last, x):  # the steps an earlier start logged past this one's checkpoint were redone
            since = x.get("start_step", x["step"] - 1)
            spans = [(lo, min(hi, since), t, n) for lo, hi, t, n in spans if lo < since]
        else:
            since = last["step"] if last is not None else x.get("start_step", 0)
        spans.append((since, x["step"], x.get("step_time_s"), launch))
        last = x
    if not held:
        return None, None
    counted = [(hi - lo, t) for lo, hi, t, n in spans if n in held]
    training = None if any(t is None for _, t in counted) else sum(steps * t for steps, t in counted)
    return sum(held.values()), training


def summary_row(run: dict) -> dict:
    """The table's row: loss at the end; speed, MFU and memory of the latest start (the layout shown)."""
    recs, launch = run["records"], run.get("launch")
    latest = [r for r in recs if r["step"] >= run["latest_start"]]
    steady = latest[1:] or latest  # the first interval warms up
    tps = [r["tokens_per_s"] for r in steady]
    mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
    peaks = [r["mem_peak_bytes"] for r in latest if "mem_peak_bytes" in r]
    return {
        "run": run["dir"], "model": run["model"], "layout": run["layout"], "steps": recs[-1]["step"],
        "final_loss": recs[-1]["loss"], "median_tokens_per_s": statistics.median(tps),
        "mfu": statistics.median(mfu) if mfu else None, "peak_memory_bytes": max(peaks) if peaks else None,
        "memory_source": recs[-1].get("mem_source"), "skipped_lines": run["skipped_lines"],
        "config_problem": run.get("config_problem"), "resumes": run.get("resumes", []),
        "legend": run.get("name"),  # what the plots call it: every layout its steps ran on
        # from shard launch's events; None for a run without them
        **{k: (launch or {}).get(k) for k in ("resizes", "steps_redone", "goodput", "time_held_s", "time_training_s")},
    }


def plot(runs: list[dict], out: Path) -> list[Path]:
    """loss vs step (and the eval loss, where logged), loss vs time, tokens/s vs step, and the expert
    load's cv (MoE) and the reward (GRPO) vs step of the runs that log them: one PNG each, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if out.exists() and not out.is_dir():
        raise ShardError(f"--out {out} is a file; give a folder for the plots")
    out.mkdir(parents=True, exist_ok=True)
    charts = [("loss_vs_step.png", "step", "loss", "loss by step"), ("loss_vs_time.png", "time_s", "loss",
              "loss by training time"), ("throughput_vs_step.png", "step", "tokens_per_s", "throughput by step")]
    paths = []
    for name, x, y, title in charts:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for run in runs:
            recs = run["records"]
            (line,) = ax.plot([r[x] for r in recs], [r[y] for r in recs], marker=".", label=run["name"])
            evaluated = [r for r in recs if r.get("eval_loss") is not None]
            if y == "loss" and evaluated:  # the held-out loss beside it, dashed in the run's colour
                ax.plot([r[x] for r in evaluated], [r["eval_loss"] for r in evaluated], marker="x", linestyle="--",
                        color=line.get_color(), label=f"{run['name']} eval")
            _mark_resumes(ax, run, x, line.get_color())
            _mark_resizes(ax, run, x, line.get_color())
        notes = ["dotted: resumed; dashed: resumed on another layout"] if any(run.get("resumes") for run in runs) else []
        notes += ["solid: resized"] if any(_resizes(run) for run in runs) else []
        ax.set_title(title + (f" ({'; '.join(notes)})" if notes else ""), fontsize=10)
        ax.set_xlabel({"time_s": "time (s)"}.get(x, x))
        ax.set_ylabel({"tokens_per_s": "tokens/s"}.get(y, y))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    for name, y, title, label in METRIC_CHARTS:
        logged = [run for run in runs if any(y in r for r in run["records"])]
        if logged:
            paths.append(_metric_chart(plt, logged, out / name, y, title, label))
    return paths


# Charts of a metric some runs log, drawn for those: (file, metric, title, y label)
METRIC_CHARTS = (("expert_load_vs_step.png", "expert_load_cv", "expert load balance by step",
                  "expert load cv (0: balanced)"),  # MoE runs: how evenly their experts were loaded
                 ("reward_vs_step.png", "reward", "mean reward by step", "reward"))  # GRPO runs


def _metric_chart(plt, runs: list[dict], path: Path, y: str, title: str, label: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        recs = [r for r in run["records"] if r.get(y) is not None]
        ax.plot([r["step"] for r in recs], [r[y] for r in recs], marker=".", label=run["name"])
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mark_resumes(ax, run: dict, x: str, color) -> None:
    """A vertical line at the step the run resumed from: dotted, dashed where it resumed on another layout
    (its mesh written beside); on the time chart where the kept steps reached that step."""
    import numpy as np

    steps, xs = [r["step"] for r in run["records"]], [r[x] for r in run["records"]]
    for resume in run.get("resumes", []):
        where = float(np.interp(resume["step"], steps, xs))
        changed = resume["layout_changed"]
        ax.axvline(where, color=color, alpha=0.6, linestyle="--" if changed else ":")
        if changed:
            ax.annotate(resume["mesh"], (where, 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                        va="top", ha="right", color=color)


def _resizes(run: dict) -> list[dict]:
    return (run.get("launch") or {}).get("resizes", [])


def _mark_resizes(ax, run: dict, x: str, color) -> None:
    """A solid vertical line at the step each resize resumed from, labelled at the foot with why, the new
    process count and mesh (on the time chart: where the run's kept steps reached that step)."""
    import numpy as np

    steps, xs = [r["step"] for r in run["records"]], [r[x] for r in run["records"]]
    for resize in _resizes(run):
        if "step" not in resize:
            continue
        where = float(np.interp(resize["step"], steps, xs))
        ax.axvline(where, color=color, alpha=0.5, linestyle="-", linewidth=2)
        label = " ".join(str(part) for part in (resize.get("reason"), "→", resize.get("processes"), "processes",
                                                 f"({resize['mesh']})" if resize.get("mesh") else None) if part is not None)
        ax.annotate(label, (where, 0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7, va="bottom",
                    ha="left", color=color)


def fresh_folder(base: Path) -> Path:
    """`base` when it is missing or empty, else the first of base-2, base-3, ... that is: an earlier
    report is never written over."""
    n, folder = 1, base
    while folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    return folder


def check_empty_out(out: Path) -> None:
    """A given --out must be new or empty (as export's): an earlier report there is not written over."""
    if out.is_dir() and any(out.iterdir()):
        raise ShardError(f"--out {out} is not empty (an earlier report?); give a new or empty folder, or leave "
                         "--out out to write a new report-N folder")


def report(run_dirs: list[str], out: Path | None) -> dict:
    """The table's rows, and the plots written to `out` (None: none written)."""
    runs = [load_run(d) for d in run_dirs]
    pngs = plot(runs, out) if out is not None else []
    return {"runs": [summary_row(r) for r in runs], "plots": [str(p) for p in pngs]}
