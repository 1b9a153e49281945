#!/usr/bin/env bash
# Install shard (editable) with the extras given as $1 (e.g. `dev`), from PyPI only.
# The `mpi` extra (part of `dev`) brings MPICH and mpi4py; mpi4jax is built here, after them, because its
# source build must see them and must not mistake a stub `nvcc` for CUDA: CUDA_ROOT points it at the
# real toolkit where /usr/local/cuda exists. With `dev`, a one-node SLURM (apt) is installed too when
# this runs as root on Debian/Ubuntu, so the srun test runs; elsewhere that test skips.
set -euo pipefail
cd "$(dirname "$0")"
extras="${1:-}"
python3 -m pip install -e ".${extras:+[$extras]}"
if python3 -c "import mpi4py" 2>/dev/null && ! python3 -c "import mpi4jax" 2>/dev/null; then
  if [ -z "${CUDA_ROOT:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_ROOT=/usr/local/cuda; fi
  python3 -m pip install "mpi4jax>=0.9"
fi
if [[ ",$extras," == *",dev,"* ]] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v srun >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge) \
    || echo "install.sh: could not install slurm-wlm; the srun test will skip" >&2
fi
