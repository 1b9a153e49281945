"""Tokens/s, MFU and peak memory of a ~1B Llama-style model on one accelerator, per remat policy, at the
largest global batch that fits (tried from large to small). Prints one line per policy.

    python benchmarks/mfu.py                       # llama-1b, seq 2048, on the machine's accelerator
    python benchmarks/mfu.py --model tiny --seq 128 --batches 8,4 --steps 3   # a CPU smoke run

MFU follows shard's one definition (docs/observing.md): 6N + causal attention at half, against the
device's bf16 peak from shard/hardware.toml (on CPU pass --peak-tflops).

Batches that the planner's memory model puts above twice the device's memory are skipped without
compiling, and those whose compiled step needs more than the device has free are skipped before
anything runs; the rest are tried from large to small, and the first that runs is reported. Twice,
because the model's activation factors were fitted on XLA:CPU and over-estimate a GPU's fused
kernels: for llama-1b at seq 2048 without remat it puts batch 24 at 169 GiB, where a count of what the
backward keeps gives about 110, so at 1.25x of an H200's 129 usable GiB that batch was never tried. A configuration that fails other than
by running out of memory is reported, and from then on XLA's attention is used.

XLA's rematerialization pass is turned off (as MaxText's GPU recipes do): left on, it recomputes
whatever it must to squeeze a batch into memory, so "the largest batch that fits" could be a slower
one than a smaller batch without the recomputation. `full` is not in the default policies: recomputing
the whole forward costs 8N instead of 6N FLOPs per token, so its MFU is bounded at three quarters of
the hardware's efficiency; pass `--remat none,dots_no_batch,full` to measure it too.
"""

import argparse
import os
import tempfile
from pathlib import Path

from shard import config, make_layout, prepare, train, parse_mesh
from shard.measure import costs, memory
from shard.startup import xla_flags
from shard.startup.compile_cache import use_compile_cache

SKIP_ABOVE = 2.0  # x the device's memory, by the planner's estimate (an upper bound on GPUs, see above)
NO_XLA_REMAT = "--xla_disable_hlo_passes=rematerialization"


def run_config(model: str, seq: int, batch: int, remat: str, steps: int, peak_tflops: float, attention: str):
    sets = [f"model.name={model}", f"model.remat={remat}", f"model.attention={attention}",
            f"data.batch={batch}", f"data.seq_len={seq}",
            "data.path=synthetic", f"steps={steps}", f"log_every={max(1, steps // 2)}", "mesh.spec=dp",
            f"observe.peak_tflops={peak_tflops}"]
    return config.resolve(config.parse_sets(sets))


def predicted_bytes(cfg) -> float:
    """The planner's per-device memory for this run (no compile)."""
    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec))
    platform = layout.mesh.devices.flat[0].platform
    return memory.memory_bytes(cfg.model, costs.LayoutShape.from_layout(layout),
                               costs.Workload.from_config(cfg, platform))["total"]


def memory_bytes(stated_gib: float) -> tuple[float | None, float | None]:
    """(the device's memory, what it has free now), after collecting what the last configuration left
    (a traceback can hold its arrays); `stated_gib` (--memory-gib) for a device that reports none."""
    import gc

    import jax

    gc.collect()
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"], stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return (stated_gib * 2**30,) * 2 if stated_gib else (None, None)


def measure(cfg, stated_gib: float = 0.0) -> dict | str:
    """The last logged record of a short run (its interval excludes the first step) plus the step's
    compiled memory, or why the batch does not fit in memory. A batch the planner puts above SKIP_ABOVE
    x the device's memory is not compiled; a compiled step that needs more than the device has free is
    not run (`prepare` then reads it from the compile cache)."""
    from shard import compile_step, memory_of

    capacity, free = memory_bytes(stated_gib)
    try:
        predicted = predicted_bytes(cfg)
        if capacity and predicted > SKIP_ABOVE * capacity:
            return f"over {SKIP_ABOVE:g}x the device's memory by the planner's estimate, not compiled"
        if free and (need := memory_of(compile_step(cfg, make_layout(cfg, parse_mesh(cfg.mesh.spec))))["total"]) > free:
            return (f"compiled step needs {need / 2**30:.2f} GiB (the planner {predicted / 2**30:.2f}), "
                    f"{free / 2**30:.2f} free: not run")
        run = prepare(cfg)
        return train(cfg, run=run)[-1] | {"compiled_bytes": run.compiled_memory.get("total", 0),
                                          "predicted_bytes": predicted}
    except Exception as e:  # out of memory shows up as an XLA runtime error
        if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
            return "out of memory"
        raise


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batches", default="64,48,32,24,16,12,8,4,2,1")
    ap.add_argument("--remat", default="none,dots_no_batch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--memory-gib", type=float, default=0.0, help="the device's memory where it reports none (CPU)")
    ap.add_argument("--attention", default="auto", help="model.attention; after an error other than out of "
                    "memory the rest runs with xla")
    args = ap.parse_args()
    if "xla_disable_hlo_passes" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_XLA_REMAT}".strip()
    xla_flags.apply(gpu_preset=True, deterministic=False)  # as `shard train` does, before JAX starts
    import jax

    # as `shard train` does: here every configuration's init is the same program, compiled once
    use_compile_cache(Path(tempfile.mkdtemp(prefix="shard-mfu-cache-")))

    print(f"{args.model}, seq {args.seq}, on {jax.devices()[0].device_kind} x {jax.device_count()}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}", flush=True)
    attention = args.attention
    remats = args.remat.split(",")
    while remats:
        remat = remats.pop(0)
        for batch in (int(b) for b in args.batches.split(",")):
            cfg = run_config(args.model, args.seq, batch, remat, args.steps, args.peak_tflops, attention)
            try:
                r = measure(cfg, args.memory_gib)
            except Exception as e:  # noqa: BLE001 -- one failed configuration must not end the benchmark
                first = (str(e).strip().splitlines() or [""])[0]
                print(f"remat {remat:14s} batch {batch:3d}: failed with attention {attention}: "
                      f"{type(e).__name__}: {first}", flush=True)
                if attention != "xla":  # this policy and the rest again with XLA's attention
                    attention = "xla"
                    remats.insert(0, remat)
                break
            if isinstance(r, str):
                print(f"remat {remat:14s} batch {batch:3d}: {r}", flush=True)
                continue
            mfu = f"{r['mfu']:.1%}" if "mfu" in r else "n/a (no peak)"
            # the device's peak is the process's so far (JAX cannot reset it); the compiled figure is this step's
            print(f"remat {remat:14s} batch {batch:3d}: {r['tokens_per_s']:12,.0f} tokens/s  MFU {mfu:>8s}  "
                  f"step memory {r['compiled_bytes'] / 2**30:6.2f} GiB (compiled; the planner "
                  f"{r['predicted_bytes'] / 2**30:.2f}), peak so far "
                  f"{r['mem_peak_bytes'] / 2**30:6.2f} GiB ({r['mem_source']})  attention {attention}", flush=True)
            break
        else:
            print(f"remat {remat:14s}: no batch fits")

if __name__ == "__main__":
    main()
