"""Connecting to the job's coordinator: `jax.distributed.initialize` within a deadline of shard's, so that
a join that never completes, or an unreachable coordinator, ends in a one-line ShardError instead of
the runtime's native abort. shard.cluster.runtime.start() calls it.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from shard.cluster.coordinator import service_in_helper, split_address
from shard.cluster import listen
from shard.cluster.jax_private import detected_cluster
from shard.cluster.launch import ClusterSpec
from shard.cluster.listen import AUTO, is_loopback
from shard.cluster.mpi import mpi_world
from shard.errors import ShardError, first_line

_JOIN_GRACE = 10.0  # seconds past the join timeout before the runtime's own deadline (a native abort)
_JOIN_NOTICE_AFTER = 10.0  # seconds of waiting to join before process 0 says it waits


class JoinStuck(ShardError):
    """A join given up (its deadline passed, or Ctrl-C) while the runtime still waits in its thread, to
    abort the process natively later: an orderly exit would wait with it."""


def connect(cluster: ClusterSpec, failure_timeout: float, join_timeout: float, bind: str = AUTO) -> None:
    """`jax.distributed.initialize`, waited for at most the join timeout. The runtime's own deadline
    ends in a native abort (a C++ check failure, exit 134), so the join runs in a thread and the
    runtime's deadline comes later (`_JOIN_GRACE`): this one gives up first, with JoinStuck; Ctrl-C
    also ends the wait."""
    import jax

    # Recoverable tasks: a lost process no longer aborts every other one from inside the runtime, so
    # the watchdog can stop them with an error that names it.
    jax.config.update("jax_enable_recoverability", True)
    local = one_host(cluster)  # under MPI: MPI starts in this thread, the one that makes the later MPI calls
    outcome: list[BaseException | None] = []

    def run():
        try:
            with service_in_helper():  # process 0's service outlives process 0, so its loss is reported
                _initialize(cluster, join_timeout, max(1, int(failure_timeout)), bind, local)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(e)

    joining = threading.Thread(target=run, name="shard-join", daemon=True)
    joining.start()
    where = f"the {cluster.launcher} cluster as process {cluster.process_id} of {cluster.num_processes}"
    try:
        joining.join(min(_JOIN_NOTICE_AFTER, join_timeout))
        # the others print their own wait for process 0
        if joining.is_alive() and cluster.process_id == 0 and join_timeout > _JOIN_NOTICE_AFTER:
            sys.stderr.write(f"waiting for the other {cluster.num_processes - 1} process(es) to join, up to "
                             f"{join_timeout:.0f}s (cluster.join_timeout)\n")
        joining.join(max(0.0, join_timeout - _JOIN_NOTICE_AFTER))
    except KeyboardInterrupt:
        raise JoinStuck(f"interrupted while joining {where}") from None
    if not outcome:
        raise JoinStuck(f"could not join {where}: not every process connected within {join_timeout:g}s (one may "
                         "have stopped on an error before joining, or not have started); cluster.join_timeout "
                         "sets the wait")
    error = outcome[0]
    if isinstance(error, RuntimeError | ValueError) and not isinstance(error, ShardError):  # XlaRuntimeError too
        raise ShardError(f"could not join {where}: {first_line(error)}") from None
    if error is not None:
        raise error


def one_host(cluster: ClusterSpec) -> bool:
    """Whether every process of the job runs on this host: a loopback --coordinator, srun on one node,
    or mpiexec whose ranks all name this host."""
    import socket

    if cluster.launcher == "explicit":
        return is_loopback(split_address(cluster.coordinator)[0])
    if cluster.launcher == "mpi":
        return len(set(mpi_world().allgather(socket.gethostname()))) == 1
    return os.environ.get("SLURM_STEP_NUM_NODES", os.environ.get("SLURM_NNODES")) == "1"


def _initialize(cluster: ClusterSpec, join_timeout: float, heartbeat_timeout: int, bind: str = AUTO,
                local: bool = False) -> None:
    import jax

    from shard.cluster import gloo

    # The runtime's deadline comes after connect's, so that connect reports a join that never completes.
    kwargs = {"initialization_timeout": int(join_timeout + 2 * _JOIN_GRACE),
              "heartbeat_timeout_seconds": heartbeat_timeout}
    if cluster.launcher == "explicit":
        address, count, rank, device_ids = cluster.coordinator, cluster.num_processes, cluster.process_id, None
    else:
        # Under mpiexec, JAX's own detection finds no coordinator; mpi4py's has rank 0 pick a free port
        # and broadcast it. SLURM: JAX reads the step's node list and task ids.
        if cluster.launcher == "mpi":
            mpi_world()
        address, count, rank, device_ids = detected_cluster("mpi4py" if cluster.launcher == "mpi" else None,
                                                            int(join_timeout))
    where = listen.plan(bind, address, local, main=rank == 0)
    if cluster.launcher == "explicit":
        if rank != 0:
            _wait_for_coordinator(where.coordinator, join_timeout)
        else:  # the others dial this name: it must resolve
            _check_resolves(where.coordinator)
    gloo.listen_on(where.gloo_host, where.gloo_interface)
    jax.distributed.initialize(where.coordinator, count, rank, local_device_ids=device_ids,
                               cluster_detection_method="deactivate",
                               coordinator_bind_address=os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or where.service,
                               **kwargs)


def _unknown_host(address: str, e: OSError) -> ShardError:
    return ShardError(f"--coordinator {address}: unknown host ({e.strerror or e})")


def _check_resolves(address: str) -> None:
    import socket

    host = split_address(address)[0]
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        raise _unknown_host(address, e) from None


def _wait_for_coordinator(address: str, timeout: float, notice_after: float = 10.0) -> None:
    """Until process 0's coordinator accepts connections, at most `timeout` seconds. JAX's own wait
    ends by aborting the process from C++ (a fatal log and a stack dump), so an unreachable coordinator
    is caught here, in one line."""
    import socket

    host, port = split_address(address)
    start = time.monotonic()
    noticed = False
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except socket.gaierror as e:
            raise _unknown_host(address, e) from None
        except OSError as e:
            waited = time.monotonic() - start
            if waited >= timeout:
                raise ShardError(f"no coordinator answers at {address} after {waited:.0f}s ({e.strerror or e}); is "
                                 "process 0 running (it may have stopped on an error), and are the address and "
                                 "firewall right?") from None
            if waited >= notice_after and not noticed:
                sys.stderr.write(f"waiting for the coordinator at {address} (process 0), up to {timeout:.0f}s\n")
                noticed = True
            time.sleep(0.5)
