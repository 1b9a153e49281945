"""Which job this process belongs to, from its launcher's environment (mpiexec, srun) or explicit flags:
pure functions of the environment, read before anything starts (shard.cluster.runtime joins the job)."""

from collections.abc import Mapping
from dataclasses import dataclass

from shard.cluster.coordinator import split_address
from shard.errors import ShardError

_MPI_RANK_VARS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                  ("PMIX_RANK", "PMIX_SIZE"))
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


@dataclass(frozen=True)
class ClusterSpec:
    """How this process joins the job: who launched it, how many processes, which one this is."""

    launcher: str  # "explicit" | "mpi" | "slurm"
    num_processes: int
    process_id: int
    coordinator: str | None = None  # HOST:PORT; None lets JAX derive it from the launcher


def detect(env: Mapping[str, str]) -> ClusterSpec | None:
    """The launcher's view of this process from its environment, or None outside a launcher.

    MPI variables win over SLURM's: `mpiexec` inside an `sbatch` script inherits the batch step's
    SLURM variables (every rank would read SLURM_PROCID=0), while srun's own PMI variables agree with SLURM.
    """
    for rank_var, size_var in _MPI_RANK_VARS:
        if rank_var in env and size_var in env:
            return ClusterSpec("mpi", int(env[size_var]), int(env[rank_var]))
    if all(v in env for v in _SLURM_VARS):
        return ClusterSpec("slurm", int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]))
    return None


def spec(env: Mapping[str, str], coordinator: str | None = None, num_processes: int | None = None,
         process_id: int | None = None) -> ClusterSpec | None:
    """The cluster this process belongs to: explicit flags, else the launcher's; None for one process."""
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given):
        if not all(given):
            raise ShardError("--coordinator, --num-processes and --process-id go together: give all three "
                             "(or none, under mpiexec or srun)")
        host, port = split_address(coordinator)
        if ":" not in coordinator or not host or not port.isdigit():
            raise ShardError(f"--coordinator expects HOST:PORT, got {coordinator!r}")
        if not 1 <= int(port) <= 65535:
            raise ShardError(f"--coordinator port must be in 1..65535, got {port}")
        if num_processes < 1:
            raise ShardError(f"--num-processes must be 1 or more, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise ShardError(f"--process-id must be in 0..{num_processes - 1}, got {process_id}")
        launched = detect(env)  # an MPI launcher's ranks (SLURM's variables may be a batch step's, not srun's)
        if launched and launched.launcher == "mpi" and launched.num_processes > 1 and \
                (launched.num_processes, launched.process_id) != (num_processes, process_id):
            raise ShardError(f"--num-processes {num_processes} --process-id {process_id} disagree with the "
                             f"{launched.launcher} launcher, which started this as process {launched.process_id} of "
                             f"{launched.num_processes}; leave the three flags out under a launcher")
        cluster = ClusterSpec("explicit", num_processes, process_id, coordinator)
    else:
        cluster = detect(env)
    return cluster if cluster and cluster.num_processes > 1 else None
