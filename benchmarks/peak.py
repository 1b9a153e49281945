"""This machine's matmul peak: the best FLOP/s per dtype (float32, bfloat16) over square, skinny and
batched shapes, through XLA and, where installed, NumPy's BLAS (float32) and PyTorch's oneDNN (both
dtypes). Prints the table, the CPU's matmul flags and thread count, and the maximum per dtype, and keeps
the maxima where shard reads them (shard.hardware.peak_cache_path: ~/.cache/shard/peak-<host>-<key>.json)
for the model and hardware FLOP shares that `shard train` and benchmarks/side_by_side.py report.

    python benchmarks/peak.py            # sizes 512..8192: 26 minutes on 2 cores shared with other work
    python benchmarks/peak.py --quick    # tiny shapes, a few seconds, nothing cached (not a peak)
    python benchmarks/peak.py --sizes 1024 2048 4096 --backend xla   # fewer shapes, one backend

Shapes per size n: square (n, n, n); skinny (4n, n, n/4), a layer's tall activation times a narrow
weight; batched 8 x (n/2, n/2, n/2), per-head products as attention has. Each is timed after a warm-up,
repeated until a second has passed (at least twice), and the best repeat counts: on a machine shared
with other work the least disturbed run is the nearest to the peak. 2mkn FLOPs per (m, k) x (k, n).
On a GPU the same shapes run through XLA (cuBLAS); the datasheet figure is in shard/hardware.toml.
"""

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DTYPES = ("float32", "bfloat16")
SIZES = (512, 1024, 2048, 4096, 8192)
QUICK_SIZES = (64, 128)


def shapes(n: int) -> dict[str, tuple[int, ...]]:
    """(batch, m, k, n) of each shape family at size n."""
    return {"square": (1, n, n, n), "skinny": (1, 4 * n, n, max(n // 4, 1)), "batched": (8, n // 2, n // 2, n // 2)}


def best_seconds(f, min_time: float) -> float:
    """The best of repeated calls of `f` after one warm-up: at least two, until `min_time` has passed."""
    f()
    times, start = [], time.perf_counter()
    while len(times) < 2 or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def xla_matmul(shape, dtype: str):
    import jax
    import jax.numpy as jnp

    b, m, k, n = shape
    x, y = jnp.ones((b, m, k), dtype), jnp.ones((b, k, n), dtype)
    # written as float32, as shard's 16-bit matmuls are on a CPU (shard.models.matmuls): XLA:CPU widens a
    # bfloat16 dot that writes bfloat16 to a float32 one, but runs this one on bfloat16 operands
    f = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    return lambda: f(x, y).block_until_ready()


def numpy_matmul(shape, dtype: str):
    if dtype != "float32":  # NumPy has no bfloat16 BLAS: ml_dtypes' matmul is a loop, not a peak
        return None
    import numpy as np

    b, m, k, n = shape
    x, y = np.ones((b, m, k), np.float32), np.ones((b, k, n), np.float32)
    return lambda: np.matmul(x, y)


def torch_matmul(shape, dtype: str):
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    b, m, k, n = shape
    t = getattr(torch, dtype)
    x, y = torch.ones((b, m, k), dtype=t), torch.ones((b, k, n), dtype=t)
    return lambda: torch.matmul(x, y)


BACKENDS = {"xla": xla_matmul, "numpy": numpy_matmul, "torch-onednn": torch_matmul}


def measure(sizes, backends, min_time: float) -> list[dict]:
    """One row per (backend, dtype, shape family, size): its best FLOP/s. Each backend runs in a process of
    its own: the thread pools of one (OpenBLAS's and XLA's spin after a call) slowed the next ~100x."""
    rows = []
    for name in backends:
        cmd = [sys.executable, __file__, "--one", name, "--min-time", str(min_time), "--sizes", *map(str, sizes)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{name}: {done.stderr.strip()[-2000:]}")
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    return rows


def measure_one(name: str, sizes, min_time: float) -> list[dict]:
    """measure()'s rows of one backend, in this process."""
    rows = []
    for dtype in DTYPES:
        for n in sizes:
            for family, shape in shapes(n).items():
                f = None if n >= 8192 and family == "batched" else BACKENDS[name](shape, dtype)
                if f is None:  # 8 x 4096^3 batched: as big as the square; a dtype the backend lacks
                    continue
                b, m, k, nn = shape
                rows.append({"backend": name, "dtype": dtype, "family": family, "shape": list(shape),
                             "flops_per_s": 2 * b * m * k * nn / best_seconds(f, min_time)})
    return rows


def peaks(rows: list[dict]) -> dict[str, dict]:
    """The best row per dtype."""
    best = {}
    for r in rows:
        if r["dtype"] not in best or r["flops_per_s"] > best[r["dtype"]]["flops_per_s"]:
            best[r["dtype"]] = r
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, a few seconds; nothing cached")
    ap.add_argument("--backend", action="append", choices=sorted(BACKENDS), help="repeatable; default all")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds each shape is repeated (default 1)")
    ap.add_argument("--one", choices=sorted(BACKENDS), help=argparse.SUPPRESS)  # a child: one backend's rows
    ap.add_argument("--sizes", type=int, nargs="+", help=f"sizes n of the shapes (default {' '.join(map(str, SIZES))})")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure_one(a.one, a.sizes, a.min_time)))
        return
    import jax

    from shard.hardware import cpu_summary, peak_cache_path

    platform = jax.devices()[0].platform
    cpu = cpu_summary()
    sizes, min_time = (QUICK_SIZES, 0.05) if a.quick else (a.sizes or SIZES, a.min_time)
    backends = a.backend or (["xla", "numpy", "torch-onednn"] if platform == "cpu" else ["xla"])
    print(f"{platform}: {cpu['model'] or 'unknown CPU'}, {cpu['threads']} thread(s), flags "
          f"{' '.join(cpu['flags']) or 'none of ' + ' '.join(('avx512_bf16', 'amx_bf16'))}; XLA devices "
          f"{jax.device_count()} ({jax.devices()[0].device_kind})", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5 * cpu["threads"]:
        print(f"warning: load average {load:.1f} on {cpu['threads']} thread(s): other work shares the cores, so "
              "this peak reads low and shares against it high; measure again on a quiet machine", flush=True)
    rows = measure(sizes, backends, min_time)
    print(f"{'backend':<13} {'dtype':<9} {'shape':<8} {'b x m x k x n':<22} {'GFLOP/s':>9}")
    for r in rows:
        print(f"{r['backend']:<13} {r['dtype']:<9} {r['family']:<8} {' x '.join(map(str, r['shape'])):<22} "
              f"{r['flops_per_s'] / 1e9:>9,.1f}")
    best = peaks(rows)
    for dtype, r in best.items():
        print(f"peak {dtype}: {r['flops_per_s'] / 1e9:,.1f} GFLOP/s ({r['backend']}, {r['family']} "
              f"{' x '.join(map(str, r['shape']))})")
    if platform != "cpu":
        from shard.hardware import hardware_for_device

        hw = hardware_for_device(jax.devices()[0].device_kind, platform)
        print(f"datasheet ({hw.name}): bf16 {hw.bf16_tflops * 1e3:,.0f} GFLOP/s" if hw
              else "datasheet: no entry in shard/hardware.toml")
    if a.quick:
        print("--quick: tiny shapes are no peak; nothing cached")
        return
    path = peak_cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "platform": platform,
           "cpu": cpu, "load_average": load, "peak_flops": {d: r["flops_per_s"] for d, r in best.items()}, "rows": rows}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)
    print(f"cached in {path}")


if __name__ == "__main__":
    main()
