"""bf16 against each FP8 recipe (precision.default, docs/performance.md) on a model (`small`) and the
embedded corpus: the loss after N steps of each, its gap to bf16's, the median step time and tokens/s.
On CPU the compute dtype is float32 and XLA:CPU runs float8 dots by converting, so the times say nothing
about FP8's speed; the losses say whether the numerics hold (the issue asks 300 steps within 2% of bf16's
loss). On a GPU (`benchmarks/gpu.sh fp8`) the times are the point.

    python benchmarks/fp8.py [--steps 300] [--recipes fp8_tensorwise,fp8_rowwise] [--mesh 1x1] [--model small]
"""

import argparse
import os
import statistics

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

from shard import config
from shard.testing import devices_for
from shard.training.loop import train


def run(recipe: str, a) -> dict:
    items = [f"model.name={a.model}", f"mesh.spec={a.mesh}", f"data.batch={a.batch}", f"data.seq_len={a.seq}",
             f"steps={a.steps}", "log_every=1", "checkpoint.every=0", f"seed={a.seed}",
             f"precision.default={recipe}"]
    records = train(config.resolve(config.parse_sets(items)), devices=devices_for(a.mesh))
    times = [r["step_time_s"] for r in records[1:] if "step_time_s" in r]
    losses = [r["loss"] for r in records]
    tail = losses[-min(10, len(losses)):]
    return {"final": losses[-1], "tail": sum(tail) / len(tail), "step_s": statistics.median(times) if times else 0.0,
            "curve": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--recipes", default="fp8_tensorwise,fp8_rowwise")
    ap.add_argument("--mesh", default="1x1")
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=int, default=0, help="also print the loss every N steps (0: final only)")
    a = ap.parse_args()
    results = {r: run(r, a) for r in ["bf16", *a.recipes.split(",")]}
    base = results["bf16"]
    print(f"{a.model} on {a.mesh}, batch {a.batch} x {a.seq}, {a.steps} steps (bf16: the compute dtype, float32 "
          "on CPU)")
    print(f"{'recipe':16s} {'final loss':>10s} {'mean last 10':>12s} {'vs bf16':>8s} {'step ms':>8s} {'tokens/s':>9s}")
    for name, r in results.items():
        gap = (r["tail"] - base["tail"]) / base["tail"] * 100
        tokens = a.batch * a.seq / r["step_s"] if r["step_s"] else 0.0
        print(f"{name:16s} {r['final']:10.4f} {r['tail']:12.4f} {gap:+7.2f}% {r['step_s'] * 1e3:8.0f} {tokens:9,.0f}")
    if a.every:
        print("step " + " ".join(f"{n:>14s}" for n in results))
        for i in range(a.every - 1, a.steps, a.every):
            print(f"{i + 1:4d} " + " ".join(f"{r['curve'][i]:14.4f}" for r in results.values()))


if __name__ == "__main__":
    main()
