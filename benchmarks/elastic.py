"""Elastic training on this machine: `shard launch` with 4 local processes x 2 simulated devices
(data=-1,model=2, the tiny model), a worker killed with kill -9 three times (the highest rank each time:
4 -> 3 -> 2 -> 1 processes). Prints, per kill, the time from the kill to the first step on the new size
and the steps redone, and the run's goodput (time training / time held, as `shard report` counts it); with
the compile cache cold (--compile-cache none: every size compiles anew) and warm (a second run over the
same sizes, its programs in the cache).

    python benchmarks/elastic.py [--steps 60] [--local-every 2] [--checkpoint-every 20] [--modes cold,warm] [--seq 32]

Goal on this machine: <= 30 s from kill to training again with a warm cache, <= 2 steps redone with
local snapshots every 2 steps.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shard.observe.metrics import read_events, read_jsonl, read_lines
from shard.observe.report import launch_summary


def run(work: Path, steps: int, local_every: int, checkpoint_every: int, cache: str, seq: int, kills: int = 3) -> dict:
    run_dir = work / "run"
    args = ["--model", "tiny", "--mesh", "data=-1,model=2", "--simulate-devices", "2", "--steps", str(steps),
            "--batch", "12", "--seq", str(seq), "--log-every", "1", "--checkpoint-every", str(checkpoint_every),
            "--set", f"checkpoint.local_every={local_every}", "--compile-cache", cache, "--run-dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    with open(work / "launch.out", "w") as out:
        supervisor = subprocess.Popen([sys.executable, "-m", "shard", "launch", "--processes", "4", "--max-restarts",
                                       str(kills), "--", *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    for k in range(kills):
        at = (k + 1) * steps // (kills + 1)
        _wait(lambda at=at: _logged(run_dir) >= at, supervisor, work)
        rank = 3 - k  # the highest of the processes running
        status = run_dir / ".launch" / f"process-{rank}.json"
        _wait(status.is_file, supervisor, work)
        os.kill(json.loads(status.read_text())["pid"], signal.SIGKILL)
        # the supervisor's line once the new size trains: "... (local snapshot, 1 step redone) after 9.8 s"
        _wait(lambda k=k: (work / "launch.out").read_text().count("redone) after") > k, supervisor, work)
    if supervisor.wait(timeout=1800):
        raise SystemExit(f"shard launch failed:\n{(work / 'launch.out').read_text()[-3000:]}")
    end = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "launch_end"][-1]
    summary = launch_summary(read_lines(run_dir / "metrics.jsonl")[0])
    return {"recoveries": end["recoveries"], "redone": [r["steps_redone"] for r in summary["resizes"]],
            "goodput": summary["goodput"], "held_s": summary["time_held_s"]}


def _logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return max((r["step"] for r in read_jsonl(path)), default=0) if path.is_file() else 0


def _wait(done, supervisor: subprocess.Popen, work: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if supervisor.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"shard launch ended early:\n{(work / 'launch.out').read_text()[-3000:]}")
        time.sleep(0.2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--local-every", type=int, default=2)
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--modes", default="cold,warm")
    ap.add_argument("--seq", type=int, default=32, help="longer: slower steps, beside which a snapshot commits")
    a = ap.parse_args()
    print(f"shard launch: 4 local processes x 2 devices, tiny at seq {a.seq}, {a.steps} steps, kill -9 of the highest rank three "
          f"times; local snapshots every {a.local_every} steps, checkpoints every {a.checkpoint_every}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        modes = a.modes.split(",")
        if "warm" in modes:  # the cache filled by a run over the same sizes
            (Path(tmp) / "fill").mkdir()
            run(Path(tmp) / "fill", a.steps, a.local_every, a.checkpoint_every, str(cache), a.seq)
        for mode in modes:
            work = Path(tmp) / mode
            work.mkdir()
            r = run(work, a.steps, a.local_every, a.checkpoint_every, "none" if mode == "cold" else str(cache), a.seq)
            times = ", ".join(f"{x['recovery_s']:.1f}" for x in r["recoveries"])
            print(f"{mode:5s} cache: kill -> training again {times} s; steps redone {r['redone']}; goodput "
                  f"{r['goodput']:.1%} of {r['held_s']:.0f} s held", flush=True)


if __name__ == "__main__":
    main()
