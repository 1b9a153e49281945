"""The GPU benchmarks' scripts, run small on CPU: a lent GPU gets one prepared call (benchmarks/gpu.sh),
so a script that broke here would waste it. They print figures; only their running and the shape of
their lines are checked, never a figure."""

import re
import subprocess
import sys
from pathlib import Path

from shard.testing import subprocess_env

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def run(script: str, *args: str, cwd: Path, devices: int = 1) -> str:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], cwd=cwd, env=subprocess_env(devices),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_mfu_prints_a_line_per_remat_policy_with_xlas_remat_off(tmp_path):
    out = run("mfu.py", "--model", "tiny", "--seq", "64", "--batches", "8,4", "--steps", "3", "--peak-tflops", "1",
              cwd=tmp_path)
    assert "--xla_disable_hlo_passes=rematerialization" in out.splitlines()[0], out
    for remat in ("none", "dots_no_batch"):
        assert re.search(rf"remat {remat} +batch +8: +[\d,]+ tokens/s +MFU +[\d.]+% +step memory", out), out


def test_compile_time_measures_the_first_compile_the_cache_hit_and_both_device_counts(tmp_path):
    out = run("compile_time.py", "--big", "tiny", "--seq", "32", "--batch", "8", "--meshes", "dp", cwd=tmp_path)
    assert re.search(r"tiny from the persistent cache \(5000 steps, not 1000\): step [\d.]+s", out), out
    for devices in (1, 8):
        assert f"tiny on {devices} device(s), mesh dp: step compile" in out, out
