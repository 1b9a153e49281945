"""Benchmark 4's three figures for shard on the side-by-side CPU configuration (reference_cpu.toml):
launch to the end of the first step, steady tokens/s and peak memory, per mesh. Each run is a fresh
`shard train` process, started as a user starts it, with an empty compile cache.

    python benchmarks/side_by_side.py [--mesh fsdp=8 --mesh fsdp=2,model=4] [--steps 12]

Launch to first step: from starting the process to the first line of its metrics.jsonl (written when
step 1 ends). Steady tokens/s: the median over steps 3.. (every step is logged). Peak memory: the
process's peak RSS (all 8 simulated devices live in it) and XLA's compiled estimate per device.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shard import read_jsonl

CONFIG = Path(__file__).with_name("reference_cpu.toml")


def _records(path: Path) -> list[dict]:
    return read_jsonl(path) if path.exists() else []


def run(mesh: str, steps: int, workdir: Path) -> dict:
    run_dir = workdir / "run"
    cmd = [sys.executable, "-m", "shard", "train", "--config", str(CONFIG), "--mesh", mesh, "--steps", str(steps),
           "--log-every", "1", "--run-dir", str(run_dir), "--compile-cache", str(workdir / "cache")]
    first = None
    with open(workdir / "output.txt", "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
        while True:  # wait4 gives this child's own peak RSS
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if first is None and _records(run_dir / "metrics.jsonl"):
                first = time.monotonic() - t0
            time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = (workdir / "output.txt").read_text()[-2000:]
        raise SystemExit(f"{mesh}: shard train exited {proc.returncode}:\n{tail}")
    records = _records(run_dir / "metrics.jsonl")
    return {"first_step_s": first, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[2:]),
            "peak_rss_bytes": usage.ru_maxrss * 1024, "compiled_bytes": records[-1]["mem_peak_bytes"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", action="append", help="mesh to run (repeatable); default fsdp=8 and fsdp=2,model=4")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    for mesh in args.mesh or ["fsdp=8", "fsdp=2,model=4"]:
        with tempfile.TemporaryDirectory() as tmp:
            r = run(mesh, max(args.steps, 4), Path(tmp))
        print(f"{mesh}: launch to first step {r['first_step_s']:.1f} s, steady {r['tokens_per_s']:,.0f} tokens/s "
              f"(median of steps 3-{max(args.steps, 4)}), peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB, "
              f"{r['compiled_bytes'] / 2**20:.0f} MiB per device (compiled)", flush=True)


if __name__ == "__main__":
    main()
