"""MPI, where a launcher (mpiexec, or srun with an MPI plugin) started the job: joining through it, the
MPI bridge's exchanges and the process sets' sub-communicators all start from its world.

MPICH's ranks open listening sockets of their own when MPI starts (its network module: UCX, the PyPI
wheel's default, or libfabric), on every interface's address. When every rank runs on this host they are
kept on the loopback interface, as the coordinator and gloo are (shard.cluster.listen), by the
environment MPI reads as it starts: `LOOPBACK_SOCKETS`, checked with `ss -ltunp` under `mpiexec -n 2`
(MPICH 5.0.2, ch4:ucx and ch4:ofi)."""

import os
import sys
from collections.abc import Mapping

from shard.cluster.listen import AUTO, LOOPBACK
from shard.errors import ShardError

# UCX's TCP transport on `lo` only; libfabric's tcp provider (FI_TCP_IFACE alone left MPICH picking
# udp;ofi_rxd on the external address). The intra-host traffic itself goes through shared memory.
LOOPBACK_SOCKETS = {"UCX_NET_DEVICES": "lo", "FI_PROVIDER": "tcp;ofi_rxm", "FI_TCP_IFACE": "lo"}


def every_rank_here(env: Mapping[str, str]) -> bool:
    """Whether the launcher started every rank on this host, read from its environment before MPI starts:
    mpiexec's (Hydra's) ranks on this node (MPI_LOCALNRANKS) are all of them (PMI_SIZE), or srun's step
    has one node."""
    if "MPI_LOCALNRANKS" in env and "PMI_SIZE" in env:
        return env["MPI_LOCALNRANKS"] == env["PMI_SIZE"]
    return env.get("SLURM_STEP_NUM_NODES") == "1"


def loopback_settings(env: Mapping[str, str], bind: str = AUTO) -> dict[str, str]:
    """What to add to the environment before MPI starts so that its ranks listen on loopback only: for
    cluster.bind `loopback`, or `auto` with every rank here. A variable the user set stays theirs."""
    if bind != LOOPBACK and not (bind == AUTO and every_rank_here(env)):
        return {}
    return {k: v for k, v in LOOPBACK_SOCKETS.items() if k not in env}


def mpi_world(bind: str = AUTO):
    """MPI's world communicator. The first call imports mpi4py, which starts MPI in the calling thread,
    its sockets where `bind` (cluster.bind) says: `loopback_settings`."""
    if "mpi4py.MPI" not in sys.modules:
        os.environ.update(loopback_settings(os.environ, bind))
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
