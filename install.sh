#!/usr/bin/env bash
# Install shard (editable) with the extras given (e.g. `dev`), from PyPI only, into a virtual environment:
# `.venv/` in the repository (or $SHARD_VENV), made on first use with `python3 -m venv --system-site-packages`,
# so a Python that refuses pip installs (Debian's and Ubuntu's, PEP 668) is never written to and packages
# already installed for python3 are reused. Afterwards `. .venv/bin/activate` puts `shard` on PATH.
#   ./install.sh [--yes] [EXTRAS]      --yes (or SHARD_INSTALL_YES=1): install system packages without asking
# The `mpi` extra (part of `dev`) brings MPICH and mpi4py; mpi4jax is built here, after them, because its
# source build must see them and must not mistake a stub `nvcc` for CUDA: CUDA_ROOT points it at the
# real toolkit where /usr/local/cuda exists. With `dev`, as root on Debian/Ubuntu, it offers to install a
# one-node SLURM (apt-get: slurm-wlm, munge) so the srun test runs; without it that test skips.
set -euo pipefail
cd "$(dirname "$0")"
yes="${SHARD_INSTALL_YES:-0}"
extras=""
for arg in "$@"; do
  case "$arg" in
    --yes|-y) yes=1 ;;
    -*) echo "install.sh: unknown option $arg (usage: ./install.sh [--yes] [EXTRAS])" >&2; exit 2 ;;
    *) extras="$arg" ;;
  esac
done

venv="${SHARD_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  echo "install.sh: making the virtual environment $venv (python3 -m venv --system-site-packages)" >&2
  # Debian's python3 without the python3-venv package has no ensurepip: a venv without its own pip can
  # still use the system's pip (python3-pip), which installs into the venv.
  python3 -m venv --system-site-packages "$venv" >/dev/null 2>&1 \
    || python3 -m venv --system-site-packages --without-pip "$venv"
  if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    echo "install.sh: $venv has no pip: install python3-venv (Debian/Ubuntu: apt-get install python3-venv)," \
         "remove $venv and run ./install.sh again" >&2
    exit 1
  fi
fi
py="$venv/bin/python"

"$py" -m pip install -e ".${extras:+[$extras]}"
if "$py" -c "import mpi4py" 2>/dev/null && ! "$py" -c "import mpi4jax" 2>/dev/null; then
  if [ -z "${CUDA_ROOT:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_ROOT=/usr/local/cuda; fi
  # its build looks for the MPI compiler (mpicc) on PATH: the mpich wheel puts it in the venv's bin/
  export PATH="$(cd "$venv" && pwd)/bin:$PATH"
  "$py" -m pip install "mpi4jax>=0.9"
fi
if [[ ",$extras," == *",dev,"* ]] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v srun >/dev/null; then
  slurm="slurm-wlm and munge (apt-get) for the srun test"
  if [ "$yes" != 1 ]; then
    if [ -t 0 ]; then
      read -r -p "install.sh: install $slurm? [y/N] " answer || answer=""
      case "$answer" in [yY]*) yes=1 ;; esac
    else
      echo "install.sh: not installing $slurm without asking (pass --yes or set SHARD_INSTALL_YES=1);" \
           "the srun test will skip" >&2
    fi
  fi
  if [ "$yes" = 1 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge) \
      || echo "install.sh: could not install slurm-wlm; the srun test will skip" >&2
  fi
fi
echo "install.sh: installed into $venv; \`. $venv/bin/activate\` puts shard on PATH" >&2
