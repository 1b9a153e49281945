#!/usr/bin/env bash
# Issue 9's GPU check (benchmarks 2 and 3 on one H200) as one prepared command for the device tool,
# sized for its 15 minutes of device time (machine start included).
#
#   benchmarks/gpu.sh fetch   # here, with PyPI: the wheels the GPU image lacks, into .whl/ (git-ignored)
#   benchmarks/gpu.sh run     # there (device tool: command "benchmarks/gpu.sh run", carry [".whl"],
#                             # timeout_s 590); the figures land in $OUT/gpu.log
#   benchmarks/gpu.sh fp8     # there, as run: FP8 (issue 52), bf16 against each recipe on llama-1b,
#                             # 200 steps each: loss, gap to bf16, tokens/s (its own call: ~10 minutes)
#
# The image there has Python 3.12, jax 0.11 with CUDA, flax, optax, orbax, rich, typer (KINDS.md) and no
# network; grain, tensorboardX, tomli-w and grain's array-record and portpicker travel as wheels.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(grain==0.2.18 array-record portpicker tensorboardX tomli-w)

fetch() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
    ls -la .whl
}

setup() {
    local out=${OUT:-/tmp/gpu-out} site=/tmp/site
    mkdir -p "$out"
    exec > >(tee "$out/gpu.log") 2>&1
    rm -rf "$site"  # a machine kept warm from an earlier call must not run the earlier code
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
    cp -r shard "$site/shard" || exit 1  # shard itself (its models and mesh presets are inside it)
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    # JAX preallocates 75% of the GPU by default; the largest batch that fits is the point of benchmark 2
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    # flax that can't import beside this jax, or XLA flags this XLA doesn't know: mended or named in seconds
    timeout 60 python3 benchmarks/preflight.py "$site" || exit 1
}
run() {
    setup
    # benchmark 2: tokens/s, MFU and peak memory of llama-1b at seq 2048 per remat policy (none, then
    # dots_no_batch); a batch whose compiled step is over the device's memory costs a compile, not a run
    timeout 370 python3 benchmarks/mfu.py --batches 32,24,16,12,8 --steps 8
    # benchmark 3: the 1B model's compile times on the GPU (the tiny model's, on CPU, are measured anywhere)
    timeout 120 python3 benchmarks/compile_time.py --meshes none
}
fp8() {
    setup
    # bf16 against fp8_tensorwise, fp8_rowwise and fp8_delayed (precision.default) on llama-1b at seq 2048
    timeout 560 python3 benchmarks/fp8.py --model llama-1b --steps 200 --batch 8 --seq 2048 \
        --recipes fp8_tensorwise,fp8_rowwise,fp8_delayed --every 50
}

case "${1:-}" in
    fetch) fetch ;;
    run) run ;;
    fp8) fp8 ;;
    *) echo "usage: benchmarks/gpu.sh fetch|run|fp8" >&2; exit 2 ;;
esac
