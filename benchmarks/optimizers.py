"""AdamW against Muon (optimizer.name) on the `small` model and the embedded corpus, on 8 simulated
devices in two layouts (`fsdp` and `2x4`): the loss curve of each and the median step time, printed as a
table and saved, with a plot of the curves, in --out (figures.json, curves.png).

Muon runs at the same lr and weight decay as AdamW: its update is scaled to RMS optimizer.muon_rms (0.2),
as Moonlight does, so one schedule serves both halves (Muon on the layers' matrices, AdamW on the rest).
On an FSDP-sharded matrix XLA partitions each Newton-Schulz matmul by all-gathering the matrix (see
docs/performance.md), so Muon's step moves more bytes than AdamW's on `fsdp`; the times say how much that
costs on simulated CPU devices, which share the host's cores (noisy; compare the two, not to a GPU).

    python benchmarks/optimizers.py [--steps 300] [--layouts fsdp,2x4] [--out optimizer-bench]
"""

import argparse
import json
import os
import statistics
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from shard import config
from shard.training.loop import train


def resolve(optimizer: str, mesh: str, a) -> config.TrainConfig:
    items = ["model.name=small", f"mesh.spec={mesh}", f"data.batch={a.batch}", f"data.seq_len={a.seq}",
             f"steps={a.steps}", "log_every=1", f"optimizer.name={optimizer}", f"optimizer.lr={a.lr}",
             "checkpoint.every=0", f"seed={a.seed}"]
    return config.resolve(config.parse_sets(items))


def curve(optimizer: str, mesh: str, a) -> dict:
    """One run's per-step losses and its median step time (the first step, which compiles, left out)."""
    records = train(resolve(optimizer, mesh, a))
    times = [r["step_time_s"] for r in records[1:] if "step_time_s" in r]
    return {"loss": [r["loss"] for r in records], "step_s": statistics.median(times) if times else float("nan")}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (mesh, runs) in zip(axes[0], results.items()):
        for name, r in runs.items():
            ax.plot(range(1, len(r["loss"]) + 1), r["loss"], label=f"{name} ({r['step_s'] * 1e3:.0f} ms/step)")
        ax.set(title=f"small on {mesh} (8 simulated devices)", xlabel="step", ylabel="loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", default="fsdp,2x4", help="comma-separated mesh specs")
    p.add_argument("--optimizers", default="adamw,muon")
    p.add_argument("--out", default="optimizer-bench", help="folder for figures.json and curves.png")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"small, batch {a.batch} x {a.seq}, {a.steps} steps, lr {a.lr}, embedded corpus, 8 simulated CPU devices")
    print(f"{'layout':<8} {'optimizer':<9} {'step ms':>8} {'loss@10%':>9} {'loss@50%':>9} {'final':>7} {'min':>7}")
    results: dict = {}
    for mesh in a.layouts.split(","):
        for name in a.optimizers.split(","):
            r = results.setdefault(mesh, {})[name] = curve(name, mesh, a)
            loss = r["loss"]
            print(f"{mesh:<8} {name:<9} {r['step_s'] * 1e3:>8.1f} {loss[len(loss) // 10]:>9.3f} "
                  f"{loss[len(loss) // 2]:>9.3f} {loss[-1]:>7.3f} {min(loss):>7.3f}", flush=True)
    (out / "figures.json").write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    plot(results, out / "curves.png")
    print(f"saved {out / 'figures.json'} and {out / 'curves.png'}")


if __name__ == "__main__":
    main()
