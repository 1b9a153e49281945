"""The GPU benchmarks' scripts, run small on CPU: a lent GPU gets one prepared call (benchmarks/gpu.sh),
so a script that broke here would waste it. They print figures; only their running and the shape of
their lines are checked (and the all-to-all bytes against their analytic minimum), never a time."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shard.testing import subprocess_env

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def run(script: str, *args: str, cwd: Path, devices: int = 1, **env: str) -> str:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], cwd=cwd,
                          env=subprocess_env(devices, **env),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_mfu_prints_a_line_per_remat_policy_with_xlas_remat_off(tmp_path):
    out = run("mfu.py", "--model", "tiny", "--seq", "64", "--batches", "8,4", "--steps", "3", "--peak-tflops", "1",
              cwd=tmp_path)
    assert "--xla_disable_hlo_passes=rematerialization" in out.splitlines()[0], out
    for remat in ("none", "dots_no_batch"):
        assert re.search(rf"remat {remat} +batch +8: +[\d,]+ tokens/s +MFU +[\d.]+% +step memory +[\d.]+ GiB "
                         r"\(compiled; the planner [\d.]+\)", out), out


def test_mfu_skips_a_batch_over_memory_by_the_estimate_uncompiled_and_by_the_compiled_step_unrun(tmp_path):
    # tiny at seq 64 on one CPU device: compiled 15.7 MiB at batch 8 and 8.8 at 4 without remat, 9.0 at 8
    # with dots_no_batch; the planner's estimate of batch 64 is far over twice 10 MiB
    out = run("mfu.py", "--model", "tiny", "--seq", "64", "--batches", "64,8,4", "--steps", "3", "--peak-tflops", "1",
              "--memory-gib", str(10 / 1024), cwd=tmp_path)
    for remat in ("none", "dots_no_batch"):
        assert f"remat {remat:14s} batch  64: over 2x the device's memory by the planner's estimate, not compiled" in out
    assert re.search(r"remat none +batch +8: compiled step needs 0.02 GiB \(the planner 0.01\), 0.01 free: not run",
                     out), out
    assert re.search(r"remat none +batch +4: +[\d,]+ tokens/s", out), out
    assert re.search(r"remat dots_no_batch +batch +8: +[\d,]+ tokens/s", out), out


def test_compile_time_measures_the_first_compile_the_cache_hit_and_both_device_counts(tmp_path):
    out = run("compile_time.py", "--big", "tiny", "--seq", "32", "--batch", "8", "--meshes", "dp", cwd=tmp_path)
    assert re.search(r"tiny from the persistent cache \(5000 steps, not 1000\): step [\d.]+s", out), out
    for devices in (1, 8):
        assert f"tiny on {devices} device(s), mesh dp: step compile" in out, out


def test_moe_prints_each_form_and_the_all_to_all_against_its_minimum(tmp_path):
    out = run("moe.py", "--steps", "1", "--batch", "8", "--seq", "8", "--layouts", "ep", "--forms",
              "dropless,capacity,dense,deepseek-style", cwd=tmp_path, devices=8)  # mixtral-style: another dropless
    lines = out.splitlines()
    assert lines[1].split() == ["layout", "form", "active", "step", "ms", "tokens/s", "a2a", "B/dev", "static", "min",
                                "ragged", "min", "ragged", "routed"], out
    rows = {re.sub(r"\s+", " ", line[7:25].strip()): line[25:].split() for line in lines[2:]}
    assert list(rows) == ["dropless", "capacity 1.25", "dense (mlp 160)", "deepseek-style"] and all(
        line.startswith("ep ") for line in lines[2:]), out
    bytes_ = {form: [int(v.replace(",", "")) for v in cells[3:]] for form, cells in rows.items()}
    # DeepSeek's attention and group-limited routing: 2 of 4 groups bound the rows a token sends
    assert 0 < bytes_["deepseek-style"][3] < bytes_["dropless"][3], out
    moved, static, ragged, routed = bytes_["dropless"]
    assert static <= moved <= 1.05 * static and ragged < static, out  # dropless: at the static-shape minimum
    assert 0 < routed < static, out  # a ragged all-to-all on this step's routing
    assert len(bytes_["capacity 1.25"]) == 1 and bytes_["capacity 1.25"][0] > 0, out
    assert bytes_["dense (mlp 160)"] == [], out  # no experts, no all-to-all


def test_fp8_prints_bf16_and_each_recipe_with_its_gap_and_the_curves(tmp_path, monkeypatch, capsys):
    """In this process (the script's imports and a subprocess cost more than its two tiny runs)."""
    import importlib.util
    import os

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # the script adds to it at import
    monkeypatch.setattr(sys, "argv", ["fp8.py", "--model", "tiny", "--steps", "2", "--batch", "8", "--seq", "32",
                                      "--recipes", "fp8_tensorwise", "--every", "1"])
    spec = importlib.util.spec_from_file_location("fp8_benchmark", BENCHMARKS / "fp8.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    out = capsys.readouterr().out
    assert "tiny on 1x1, batch 8 x 32, 2 steps" in out, out
    for recipe in ("bf16", "fp8_tensorwise"):
        assert re.search(rf"^{recipe} +\d+\.\d{{4}} +\d+\.\d{{4}} +[+-]\d+\.\d\d% +\d+ +[\d,]+$", out, re.M), out
    assert re.search(r"^ +2 +\d+\.\d{4} +\d+\.\d{4}$", out, re.M), out  # the curves, a step a line
    assert not any(tmp_path.iterdir())  # no run directory left behind


def test_every_mutant_still_applies_and_names_tests_that_exist():
    """benchmarks/mutants.py runs on demand, not here: only that each patch's text is in the source once
    and each test it names exists, so the mutants keep up with the code they mutate."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutants", BENCHMARKS / "mutants.py")
    mutants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutants)
    assert len(mutants.MUTANTS) >= 17 and mutants.check_patches() == []


def test_peak_quick_prints_every_shape_the_maxima_and_the_cpu_and_caches_nothing(tmp_path):
    out = run("peak.py", "--quick", "--backend", "xla", "--backend", "numpy", cwd=tmp_path,
              SHARD_PEAK_FILE=str(tmp_path / "peak.json"))
    assert re.match(r"cpu: .*, \d+ thread\(s\), flags ", out), out
    for dtype in ("float32", "bfloat16"):
        for family in ("square", "skinny", "batched"):
            assert re.search(rf"^xla +{dtype} +{family} +[\dx ]+ +[\d,.]+$", out, re.M), out
        assert re.search(rf"^peak {dtype}: [\d,.]+ GFLOP/s \((xla|numpy), ", out, re.M), out
    assert re.search(r"^numpy +float32 +square", out, re.M) and not re.search(r"^numpy +bfloat16", out, re.M), out
    assert "nothing cached" in out and not (tmp_path / "peak.json").exists(), out


def test_rl_splits_a_grpo_step_and_times_the_kv_cache_against_uncached_sampling(capsys, monkeypatch):
    """In this process (its 8 simulated devices are the script's): no second interpreter, import and start."""
    import importlib.util
    import os

    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"])  # the script adds its device count at import
    monkeypatch.setattr(sys, "argv", ["rl.py", "--steps", "1", "--batch", "8", "--group", "4", "--seq", "32",
                                      "--new", "4"])
    spec = importlib.util.spec_from_file_location("rl_benchmark", BENCHMARKS / "rl.py")
    rl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rl)
    rl.main()
    lines = capsys.readouterr().out.splitlines()
    out = "\n".join(lines)
    assert lines[0] == "GRPO tiny on 2x4: 8 completions a step (4 a prompt), 4 new tokens, seq 32; medians of 1 steps", out
    parts = [re.fullmatch(rf"  {name} +([\d.]+) ms +([\d.]+)%", line) for name, line in
             zip(("rollout", "reference", "training"), lines[1:4])]
    assert all(parts) and all(float(p[1]) > 0 for p in parts), out  # training: the step's time less the other two
    assert sum(float(p[2]) for p in parts) == pytest.approx(100, abs=0.2), out
    assert re.fullmatch(r"  rollout tokens/s: KV cache [\d,]+, uncached [\d,]+ \([\d.]+x\)", lines[4]), out
    # the uncached loop once timed a compile (its rows placed otherwise than at its warm-up call)
    assert re.fullmatch(r"  compiles while timed: \d+ in the steps, 0 in the uncached loop", lines[5]), out


def test_ceiling_times_each_matmul_of_the_step_and_bounds_the_shares(capsys, monkeypatch, tmp_path):
    """In this process (its 8 simulated devices are the script's); a planted peak, so the shares print."""
    import importlib.util
    import json

    (tmp_path / "peak.json").write_text(json.dumps({"peak_flops": {"float32": 1e13, "bfloat16": 2e13}}))
    monkeypatch.setenv("SHARD_PEAK_FILE", str(tmp_path / "peak.json"))
    monkeypatch.setattr(sys, "argv", ["ceiling.py", "--quick", "--top", "3"])
    spec = importlib.util.spec_from_file_location("ceiling_benchmark", BENCHMARKS / "ceiling.py")
    ceiling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ceiling)
    ceiling.main()
    out = capsys.readouterr().out
    assert re.search(r"^fsdp=8 \(8 devices, float32, remat none\): \d+ distinct dots, \d+ per step, ", out, re.M), out
    assert len(re.findall(r"^ *[\d.]+% +[\d.]+ +\d+ +\d+  f32\[", out, re.M)) == 3, out
    assert re.search(r"^the optimizer's update alone \(adamw\): [\d.]+ ms; the loss's 0.1M exponentials \(one per "
                     r"logit\) at the best rate: [\d.]+ ms$", out, re.M), out
    bounds = re.findall(r"^ceiling fsdp=8, (matmuls[^:]*): ([\d,.]+) ms a step, [\d,]+ tokens/s, "
                        r"MFU ([\d.]+)%, HFU ([\d.]+)% of the float32 peak 10,000.0 GFLOP/s$", out, re.M)
    assert [b[0] for b in bounds] == ["matmuls", "matmuls + optimizer", "matmuls + optimizer + the loss's exponentials"], out
    seconds = [float(b[1].replace(",", "")) for b in bounds]
    assert seconds[0] < seconds[1] <= seconds[2] and 0 < float(bounds[0][2]) <= float(bounds[0][3]), out
