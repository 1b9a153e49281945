"""MPI, where a launcher (mpiexec, or srun with an MPI plugin) started the job: joining through it, the
MPI bridge's exchanges and the process sets' sub-communicators all start from its world."""

import sys

from shard.errors import ShardError


def mpi_world():
    """MPI's world communicator (the first call imports mpi4py, which starts MPI in the calling thread)."""
    try:
        from mpi4py import MPI as _MPI
    except ImportError:
        raise ShardError("MPI is not installed: run `./install.sh mpi` (mpich, mpi4py, and mpi4jax built "
                         "against them)") from None
    return _MPI.COMM_WORLD


def mpi_available() -> bool:
    """True when mpi4py is importable and MPI has been started in this process."""
    if "mpi4py.MPI" not in sys.modules:
        return False
    from mpi4py import MPI as _MPI

    return _MPI.Is_initialized() and not _MPI.Is_finalized()
