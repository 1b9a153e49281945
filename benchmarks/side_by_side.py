"""The side-by-side CPU configuration (reference_cpu.toml: the untied 20.6M model, seq 256, global batch 8,
8 simulated devices), per mesh and per variant: launch to the end of the first step, steady tokens/s,
peak RSS, and the model and hardware FLOP shares of this machine's matmul peak. Each run is a fresh
`shard train` process, started as a user starts it, with an empty compile cache; runs are interleaved
(every mesh and variant once, then again) and each figure is reported as the range over the repeats.

    python benchmarks/side_by_side.py [--mesh fsdp=8 --mesh fsdp=2,model=4] [--steps 12] [--repeats 2]
        [--variant defaults --variant fp32 --variant no-hugepages --variant no-trim]

Variants: `defaults` (shard's CPU defaults: on a CPU with bfloat16 matmul instructions, bfloat16 with full
remat), `bf16-remat` (bfloat16 compute, full remat), `bf16-dots` (bfloat16, remat keeping the projections'
outputs: dots_no_batch), `bf16` (bfloat16, no remat), `fp32` (float32 compute, no remat: the CPU defaults
before), and the defaults without each host-side setting shard applies: `no-hugepages` (glibc's huge pages
for malloc off: GLIBC_TUNABLES=glibc.malloc.hugetlb=0) and `no-trim` (the memory freed by the compile kept
by malloc: SHARD_RELEASE_FREED_MEMORY=0). shard sets no thread counts; XLA:CPU uses every core.

Launch to first step: from starting the process to the first line of its metrics.jsonl (written when
step 1 ends). Steady tokens/s: the median over steps 3.. (every step is logged). Peak RSS: the process's
own (all 8 simulated devices live in it). Model FLOP share (MFU): tokens/s x shard's MFU count per token
(6N plus causal attention, `mfu_flops_per_token`) / the peak; hardware FLOP share: tokens/s x the FLOPs
the step runs per token (the whole attention square and remat's recompute, `hardware_flops_per_token`)
/ the peak. The peak: this machine's best matmul rate in the step's dtype as benchmarks/peak.py measured
it (its cache; measured first where there is none). A share above 100% stops the benchmark as the bug
it is (shard.hardware.flop_shares).

MaxText's side (`--maxtext SRC --maxtext-python PY`): the same model (untied, 4 layers of 256, MLP 1024,
vocab 32000, seq 256, global batch 8 as 1 per device, bfloat16 compute on float32 weights, full remat,
AdamW, synthetic data) through MaxText's own pre-training entry point from a checkout `SRC` (its
`src/maxtext`), run by `PY`, the interpreter of an environment MaxText's requirements are installed in,
with the same 8 simulated devices and the glibc huge pages shard sets for itself
(GLIBC_TUNABLES=glibc.malloc.hugetlb=1); the meshes map to ici_fsdp_parallelism and
ici_tensor_parallelism. Steady tokens/s: 2,048 over the median of its logged step times from step 3 on
(MaxText counts from 0). MaxText needs Python 3.12; on 3.11 its two `type X = ...` aliases under
src/maxtext/kernels/mhc must be written as plain assignments.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from shard import read_jsonl

CONFIG = Path(__file__).with_name("reference_cpu.toml")
VARIANTS = {
    "defaults": ([], {}),
    "bf16-remat": (["model.compute_dtype=bfloat16", "model.remat=full"], {}),
    "bf16-dots": (["model.compute_dtype=bfloat16", "model.remat=dots_no_batch"], {}),
    "bf16": (["model.compute_dtype=bfloat16", "model.remat=none"], {}),
    "fp32": (["model.compute_dtype=float32", "model.remat=none"], {}),
    "no-hugepages": ([], {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}),
    "no-trim": ([], {"SHARD_RELEASE_FREED_MEMORY": "0"}),
}


def _records(path: Path) -> list[dict]:
    return read_jsonl(path) if path.exists() else []


def run(mesh: str, variant: str, steps: int, workdir: Path) -> dict:
    sets, env = VARIANTS[variant]
    run_dir = workdir / "run"
    cmd = [sys.executable, "-m", "shard", "train", "--config", str(CONFIG), "--mesh", mesh, "--steps", str(steps),
           "--log-every", "1", "--run-dir", str(run_dir), "--compile-cache", str(workdir / "cache")]
    cmd += [a for s in sets for a in ("--set", s)]
    first = None
    with open(workdir / "output.txt", "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env={**os.environ, **env})
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
        raise SystemExit(f"{mesh} {variant}: shard train exited {proc.returncode}:\n{tail}")
    records = _records(run_dir / "metrics.jsonl")
    return {"first_step_s": first, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[2:]),
            "peak_rss_mib": usage.ru_maxrss / 1024}


DEVICES = 8  # simulated CPU devices, for both sides (reference_cpu.toml's meshes)
MAXTEXT_MESH = {"fsdp": "ici_fsdp_parallelism", "model": "ici_tensor_parallelism", "data": "ici_data_parallelism"}


def maxtext_command(mesh: str, steps: int, out_dir: Path, python: str) -> list[str]:
    """MaxText's pre-training on the reference config and `mesh` (its axes as ici_*_parallelism)."""
    doc = tomllib.loads(CONFIG.read_text())
    m, d = doc["model"], doc["data"]
    sizes = dict(kv.split("=") for kv in mesh.split(","))
    parallel = [f"{MAXTEXT_MESH[a]}={sizes.get(a, 1)}" for a in MAXTEXT_MESH]
    return [python, "-m", "maxtext.trainers.pre_train.train", "src/maxtext/configs/base.yml", "run_name=side_by_side",
            f"base_output_directory={out_dir}", "hardware=cpu", "skip_jax_distributed_system=true",
            "dataset_type=synthetic", f"steps={steps}", f"per_device_batch_size={d['batch'] / DEVICES:g}",
            f"max_target_length={d['seq_len']}", f"base_emb_dim={m['d_model']}", f"base_num_decoder_layers={m['n_layers']}",
            f"base_num_query_heads={m['n_heads']}", f"base_num_kv_heads={m['n_kv_heads']}", f"head_dim={m['head_dim']}",
            f"base_mlp_dim={m['mlp_dim']}", f"vocab_size={m['vocab_size']}",
            f"logits_via_embedding={str(m['tie_embeddings']).lower()}", "decoder_block=llama2", "dtype=bfloat16",
            "weight_dtype=float32", "remat_policy=full", "opt_type=adamw", "enable_checkpointing=false",
            "eval_interval=-1", "enable_tensorboard=false", *parallel]


def check_maxtext(src: Path, python: str, meshes: list[str]) -> None:
    """Refuse, in one line before any run, a checkout without src/maxtext, an interpreter that is not
    there, or a mesh MaxText's side can't take."""
    if not (src / "src" / "maxtext").is_dir():
        raise SystemExit(f"--maxtext {src}: not a MaxText checkout (no src/maxtext in it)")
    if shutil.which(python) is None:
        raise SystemExit(f"--maxtext-python {python}: no such interpreter")
    for mesh in meshes:
        axes = {kv.split("=")[0] for kv in mesh.split(",")}
        if not axes <= set(MAXTEXT_MESH):
            raise SystemExit(f"--maxtext: mesh {mesh} has axes with no MaxText counterpart here "
                             f"(it takes {', '.join(MAXTEXT_MESH)})")


def run_maxtext(mesh: str, steps: int, workdir: Path, src: Path, python: str) -> dict:
    """One MaxText run: launch to its first logged step, steady tokens/s and peak RSS, as `run` gives shard's."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}", "JAX_PLATFORMS": "cpu",
           "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "DECOUPLE_GCLOUD": "TRUE", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(src / "src")}
    log = workdir / "maxtext.txt"
    first, times = None, {}
    with open(log, "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(maxtext_command(mesh, steps, workdir / "out", python), stdout=out,
                                stderr=subprocess.STDOUT, cwd=src, env=env)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if first is None and "completed step:" in log.read_text():
                first = time.monotonic() - t0
            time.sleep(0.05)
    for m in re.finditer(r"completed step: (\d+), seconds: ([0-9.]+)", log.read_text()):
        times[int(m.group(1))] = float(m.group(2))
    code = os.waitstatus_to_exitcode(status)
    if code or len(times) < 3:
        why = f"exited {code}" if code else f"logged {len(times)} steps, fewer than the 3 a steady rate needs"
        raise SystemExit(f"{mesh} MaxText: {why}:\n{log.read_text()[-2000:]}")
    doc = tomllib.loads(CONFIG.read_text())
    tokens = doc["data"]["batch"] * doc["data"]["seq_len"]
    return {"first_step_s": first, "tokens_per_s": tokens / statistics.median(t for s, t in times.items() if s >= 2),
            "peak_rss_mib": usage.ru_maxrss / 1024}


def peak_flops() -> dict[str, float]:
    """This machine's matmul peak per dtype from benchmarks/peak.py's cache, measured first if absent."""
    from shard.hardware import measured_peak

    if measured_peak("float32") is None:
        print("no matmul peak cached for this machine: measuring it (benchmarks/peak.py)", flush=True)
        subprocess.run([sys.executable, str(Path(__file__).with_name("peak.py"))], check=True)
    return {dtype: measured_peak(dtype) for dtype in ("float32", "bfloat16")}


def flops_per_token(variant: str) -> tuple[float, float, int]:
    """shard's MFU count per token of the reference model, the FLOPs its step runs per token under the
    variant's remat policy, and its sequence length."""
    from shard.config.model import ModelConfig
    from shard.config.flops import hardware_flops_per_token, mfu_flops_per_token
    from shard.config.presets import PRESETS

    doc = tomllib.loads(CONFIG.read_text())
    fields = {k: v for k, v in doc["model"].items() if k != "name"}
    fields |= {k.removeprefix("model."): v for k, v in (s.split("=", 1) for s in VARIANTS[variant][0])}
    base = PRESETS.get(doc["model"].get("name", "small"), ModelConfig())
    cfg = ModelConfig(**{**vars(base), **fields})
    seq = doc["data"]["seq_len"]
    return mfu_flops_per_token(cfg, seq), hardware_flops_per_token(cfg, seq, "cpu"), seq


def step_dtype(variant: str) -> str:
    """The compute dtype a variant's step runs in on CPU."""
    sets = dict(s.split("=", 1) for s in VARIANTS[variant][0])
    if "model.compute_dtype" in sets:
        return sets["model.compute_dtype"]
    from shard.config.model import ModelConfig

    doc = tomllib.loads(CONFIG.read_text())
    return ModelConfig(compute_dtype=doc["model"].get("compute_dtype", "auto")).compute_dtype_on("cpu")


def _range(values, fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if lo == hi else f"{format(lo, fmt)}-{format(hi, fmt)}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", action="append", help="mesh to run (repeatable); default fsdp=8 and fsdp=2,model=4")
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS),
                    help="repeatable; default: defaults and fp32")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--maxtext", type=Path, help="a MaxText checkout (its src/maxtext) to run beside shard")
    ap.add_argument("--maxtext-python", default=sys.executable,
                    help="the interpreter of the environment MaxText's requirements are installed in")
    args = ap.parse_args()
    meshes, variants = args.mesh or ["fsdp=8", "fsdp=2,model=4"], args.variant or ["defaults", "fp32"]
    steps = max(args.steps, 4)
    if args.maxtext is None:
        print("MaxText: no --maxtext checkout given, so its side is absent; shard's figures follow", flush=True)
    else:
        check_maxtext(args.maxtext, args.maxtext_python, meshes)
    peak = peak_flops()
    print(f"matmul peak of this CPU (benchmarks/peak.py): float32 {peak['float32'] / 1e9:.0f} GFLOP/s, "
          f"bfloat16 {peak['bfloat16'] / 1e9:.0f} GFLOP/s", flush=True)
    results: dict[tuple[str, str], list[dict]] = {}
    maxtext: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for mesh in meshes:
            for variant in variants:
                with tempfile.TemporaryDirectory() as tmp:
                    results.setdefault((mesh, variant), []).append(run(mesh, variant, steps, Path(tmp)))
            if args.maxtext is not None:
                with tempfile.TemporaryDirectory() as tmp:
                    maxtext.setdefault(mesh, []).append(
                        run_maxtext(mesh, steps, Path(tmp), args.maxtext.resolve(), args.maxtext_python))
    for (mesh, variant), rs in results.items():
        print(summary(mesh, variant, rs, steps, peak[step_dtype(variant)]), flush=True)
    for mesh, rs in maxtext.items():
        # MaxText runs what the bf16-remat variant runs: bfloat16, full remat
        print(summary(mesh, "bf16-remat", rs, steps, peak["bfloat16"], label="MaxText"), flush=True)
        for variant in variants:
            ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(results[mesh, variant], rs)]
            print(f"{mesh} {variant}: {_range(ratios, '.2f')}x MaxText's tokens/s (run by run)", flush=True)


def summary(mesh: str, variant: str, rs: list[dict], steps: int, peak: float, label: str = "") -> str:
    """One line of a mesh and variant's runs (`label`: another framework's runs of that variant): each
    figure's range over the repeats."""
    from shard.hardware import flop_shares

    model, hardware, seq = flops_per_token(variant)
    tps = [r["tokens_per_s"] for r in rs]
    shares = [flop_shares(t * model, t * hardware, peak) for t in tps]
    return (f"{mesh} {label or variant}: launch to first step {_range([r['first_step_s'] for r in rs], '.1f')} s, "
            f"steady {_range(tps, ',.0f')} tokens/s (median of steps 3-{steps}), "
            f"peak RSS {_range([r['peak_rss_mib'] for r in rs], ',.0f')} MiB, "
            f"model {_range([t * model / 1e9 for t in tps], '.0f')} GFLOP/s: MFU "
            f"{_range([m * 100 for m, _ in shares], '.0f')}%, HFU {_range([h * 100 for _, h in shares], '.0f')}% "
            f"of the {step_dtype(variant)} peak ({len(rs)} runs, seq {seq})")


if __name__ == "__main__":
    main()
