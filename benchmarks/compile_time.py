"""Compile times: the ~1B model's train step (first compile, then a persistent-cache hit in a new
process that trains for another number of steps), and the tiny model on 1 vs 8 simulated devices.
Each case runs in a fresh process so device counts and caches start clean. Everything is compiled
from shapes (AOT): nothing is allocated.

    python benchmarks/compile_time.py [--big llama-1b] [--seq 2048] [--batch 8] [--meshes dp,fsdp_tp:4x2]
    python benchmarks/compile_time.py --meshes none   # the big model only (on a GPU machine: the tiny
                                                      # model's cases run on CPU and are measured anywhere)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from shard.startup.devices import with_host_devices

CASE = r"""
import json, os, sys, time
t0 = time.perf_counter()
from shard.startup import xla_flags
xla_flags.apply(gpu_preset=True, deterministic=False)  # as `shard train` does (GPU only)
import jax
from shard import config, compile_step, make_layout, parse_mesh, state_spec
from shard.training.state import compile_init
model, mesh, seq, batch, attention, steps = sys.argv[1:3] + [int(a) for a in sys.argv[3:5]] + sys.argv[5:7]
cfg = config.resolve(config.parse_sets([f"model.name={model}", f"mesh.spec={mesh}", f"data.seq_len={seq}",
                                        f"data.batch={batch}", "data.path=synthetic", f"model.attention={attention}",
                                        f"steps={steps}"]))
layout = make_layout(cfg, parse_mesh(mesh))
t1 = time.perf_counter()
compile_step(cfg, layout)
t2 = time.perf_counter()
compile_init(state_spec(cfg.model, cfg.optimizer, cfg.steps, layout), cfg.model, 0)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "step_compile_s": t2 - t1, "init_compile_s": t3 - t2}))
"""


def run_case(model, mesh, devices, seq, batch, cache_dir, platform=None, attention="auto", steps=1000):
    """One compile in a fresh process; `platform="cpu"` for simulated devices on a machine with a GPU.
    {"error": stderr}, after printing it, when it fails: one failed case must not end the benchmark."""
    # the caller's XLA_FLAGS (the tests': -O0), with this case's device count
    env = dict(os.environ, XLA_FLAGS=with_host_devices(os.environ.get("XLA_FLAGS", ""), devices))
    if platform:
        env["JAX_PLATFORMS"] = platform
    if cache_dir:
        env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    else:
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    # -P: not the working directory first on the path, so `shard` is the installed one (with shard.models)
    out = subprocess.run([sys.executable, "-P", "-c", CASE, model, mesh, str(seq), str(batch), attention, str(steps)],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        print(f"{model} on mesh {mesh} with attention {attention} failed (exit {out.returncode}):\n"
              f"{out.stderr[-3000:]}", flush=True)
        return {"error": out.stderr}
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        print(f"{model} on mesh {mesh}: no figures in its output:\n{out.stdout[-3000:]}", flush=True)
        return {"error": out.stdout}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", default="llama-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--meshes", default="dp,fsdp_tp:4x2",
                    help="the tiny model's meshes on 8 devices: presets or shapes such as 2x4, comma-separated "
                         "(on 1 device: dp); none: no tiny-model cases")
    args = ap.parse_args()
    measured = 0
    with tempfile.TemporaryDirectory() as cache:
        attention = "auto"
        first = run_case(args.big, "dp", 1, args.seq, args.batch, cache)
        if "error" in first and "RESOURCE_EXHAUSTED" not in first["error"]:  # e.g. cuDNN attention on this CUDA
            attention = "xla"
            first = run_case(args.big, "dp", 1, args.seq, args.batch, cache, attention=attention)
        if "error" not in first:
            measured += 1
            print(f"{args.big} (seq {args.seq}, batch {args.batch}, 1 device, attention {attention}): step compile "
                  f"{first['step_compile_s']:.1f}s, init {first['init_compile_s']:.1f}s", flush=True)
            # another --steps: the schedule's numbers are arguments of the step, so it still hits
            hit = run_case(args.big, "dp", 1, args.seq, args.batch, cache, attention=attention, steps=5000)
            if "error" not in hit:
                measured += 1
                print(f"{args.big} from the persistent cache (5000 steps, not 1000): step {hit['step_compile_s']:.1f}s, "
                      f"init {hit['init_compile_s']:.1f}s", flush=True)
    tiny = [] if args.meshes == "none" else [(1, "dp")] + [(8, mesh) for mesh in args.meshes.split(",")]
    for devices, mesh in tiny:
        r = run_case("tiny", mesh, devices, 32, 8, None, platform="cpu")
        if "error" not in r:
            measured += 1
            print(f"tiny on {devices} device(s), mesh {mesh}: step compile {r['step_compile_s']:.1f}s, "
                  f"init {r['init_compile_s']:.1f}s (import {r['import_s']:.1f}s)", flush=True)
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
