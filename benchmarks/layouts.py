"""Per-device memory and step time of the tiny/small models across layouts on 8 simulated devices,
and the pipeline bubble of each schedule (gpipe, 1f1b, interleaved V = 2, zero_bubble at S = 4): by
formula, by schedule table, and as the step times imply.

Memory is XLA's compiled estimate for the whole train step (arguments + temporaries + outputs -
donated, per device). Step time is the median of timed steps after a warm-up; on simulated CPU
devices the 8 "devices" share the host's cores, so times compare layouts' work, not real scaling.

Bubble: the schedule tables give the idle share of (tick, stage) slots; timing gives another
estimate: with a fixed microbatch size, step time T(M) = c M + (fill and drain) + overhead, so c is the
slope of T over M and the timed bubble is 1 - c M / T(M).

    python benchmarks/layouts.py [--models tiny,small] [--steps 5] [--bubble-model tiny] [--only 1f1b]
"""

import argparse
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from shard import config, prepare
from shard.parallel import schedule
from shard.testing import median_step_seconds

# (label, mesh, extra --set keys, model override)
LAYOUTS = [
    ("dp", "dp", {}, None),
    ("fsdp", "fsdp", {}, None),
    ("tp (data=4,model=2)", "4x2", {}, None),
    ("megatron-sp", "sp", {}, None),
    ("context (data=2,context=4)", "cp", {}, None),
    ("pipeline gpipe (stage=2,data=4)", "pipeline", {"pipeline.schedule": "gpipe"}, None),
    ("pipeline 1f1b (stage=2,data=4)", "pipeline", {"pipeline.schedule": "1f1b"}, None),
    ("pipeline 1f1b x tp (2x2x2)", "pipeline_tp", {"pipeline.schedule": "1f1b"}, None),
    ("moe replicated experts (data=8)", "dp", {}, "moe"),
    ("moe expert parallel (data=2,expert=4)", "ep", {}, "moe"),
]


def resolve(model: str, mesh: str, sets: dict, batch: int, seq: int):
    items = [f"model.name={model}", f"mesh.spec={mesh}", f"data.batch={batch}", f"data.seq_len={seq}",
             "data.path=synthetic", "steps=100", "optimizer.warmup_steps=1"]
    items += [f"{k}={v}" for k, v in sets.items()]
    return config.resolve(config.parse_sets(items))


def layouts(models: list[str], steps: int, batch: int, seq: int, only: str = "") -> None:
    print(f"{'model':<9} {'layout':<40} {'step MiB/dev':>12} {'params MiB/dev':>14} {'step ms':>9} {'loss':>7}")
    for model in models:
        for label, mesh, sets, moe in LAYOUTS:
            name = "moe-tiny" if moe else model
            if (moe and model != models[0]) or only not in label:
                continue
            sets = dict(sets)
            if "pipeline" in mesh:
                sets.setdefault("pipeline.microbatches", 4)
            cfg = resolve(name, mesh, sets, batch, seq)
            run = prepare(cfg)
            ms = median_step_seconds(run, steps) * 1e3
            mem = run.compiled_memory
            params = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(run.state["params"]))
            loss = float(run.step_fn(run.state, run.stream.next())[1]["loss"])
            print(f"{name:<9} {label:<40} {mem['total'] / 2**20:>12.2f} {params / 2**20:>14.2f} {ms:>9.1f} "
                  f"{loss:>7.3f}", flush=True)


SCHEDULE_ROWS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1))


def bubble(model: str, steps: int, rows_per_micro: int, seq: int, micro=(4, 8, 16)) -> None:
    """Each schedule at S = 4 (stage=4,data=2, 8 layers so that interleaved V = 2 has a layer a chunk):
    the bubble by formula and by table (the same object: the table the executor runs), the step time,
    the bubble the times imply, and memory per device."""
    S = 4
    print(f"\npipeline bubble, {model} (8 layers), stage=4 x data=2, {rows_per_micro} rows per microbatch per replica")
    print(f"{'schedule':<14} {'M':>3} {'formula':>8} {'schedule table':>15} {'timed':>7} {'step ms':>9} "
          f"{'step MiB/dev':>12} {'temp MiB/dev':>12}")
    for kind, v in SCHEDULE_ROWS:
        times, mems = [], []
        for m in micro:
            cfg = resolve(model, "stage=4,data=2", {"pipeline.schedule": kind, "pipeline.microbatches": m,
                                                    "pipeline.virtual_stages": v, "model.n_layers": 8},
                          rows_per_micro * 2 * m, seq)
            run = prepare(cfg)
            times.append(median_step_seconds(run, steps))
            mems.append(run.compiled_memory)
        c = np.polyfit(np.array(micro, float), np.array(times), 1)[0]
        label = kind + (f" V={v}" if v > 1 else "")
        for m, t, mem in zip(micro, times, mems):
            print(f"{label:<14} {m:>3} {schedule.bubble_formula(kind, S, m, v):>8.3f} "
                  f"{schedule.build(kind, S, m, v).idle_fraction():>15.3f} {1 - c * m / t:>7.3f} {t * 1e3:>9.1f} "
                  f"{mem['total'] / 2**20:>12.2f} {mem['temporaries'] / 2**20:>12.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--bubble-model", default="tiny")
    p.add_argument("--only", default="", help="run only layouts whose label contains this")
    p.add_argument("--skip-layouts", action="store_true")
    a = p.parse_args()
    if not a.skip_layouts:
        layouts(a.models.split(","), a.steps, a.batch, a.seq, a.only)
    if a.bubble_model:
        bubble(a.bubble_model, a.steps, 2, a.seq)


if __name__ == "__main__":
    main()
