"""Values between the processes of one job: a barrier, process 0's text on every process, every
process's text on every process, and whether a flag is set on any of them. One process: each returns
at once. Under jax.distributed they go through the coordination service (shard.cluster.runtime's
client), under the MPI bridge through MPI.
"""

from __future__ import annotations

import numpy as np

from shard.cluster.mpi import mpi_world
from shard.cluster.runtime import MPI, XLA, context, fail, service_client

STARTUP_TIMEOUT = 1800.0  # seconds live processes may wait for each other to connect and compile


def barrier(name: str, timeout: float = STARTUP_TIMEOUT) -> None:
    """Wait until every process gets here (a live but slow one up to `timeout`; a lost one is reported
    by the watchdog within the failure timeout).

    Before the first cross-process computations: gloo's rendezvous gives up after a fixed 30 s, and
    one process can reach it that much later than another when compiling on a busy machine.
    """
    ctx = context()
    if ctx.mode == XLA:
        try:
            service_client().wait_at_barrier(f"shard_{name}", int(timeout * 1000))
        except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
            fail(e)
    elif ctx.mode == MPI:
        mpi_world().Barrier()


def _next_exchange(kind: str):
    """(coordination-service client, this exchange's key): every process makes the exchanges in the same
    order, so the n-th one's key is the same everywhere."""
    ctx = context()
    key = f"shard/{kind}/{ctx.exchanges}"
    ctx.exchanges += 1
    return service_client(), key


_BROADCAST_WAIT_MS = 3_600_000  # a lost process 0 is the watchdog's to report, within the failure timeout


def broadcast_text(text: str) -> str:
    """Process 0's `text` on every process (e.g. the run dir it chose, its config); one process:
    unchanged."""
    ctx = context()
    if ctx.mode == MPI:
        return mpi_world().bcast(text, root=0)
    if ctx.mode == XLA and ctx.size > 1:
        # Through the coordination service's key-value store, not a device collective: that one needs
        # every process to hold as many devices, which is among what the config check is there to find.
        client, key = _next_exchange("broadcast")
        try:
            if ctx.rank == 0:
                client.key_value_set(key, text)
                return text
            return client.blocking_key_value_get(key, _BROADCAST_WAIT_MS)
        except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
            fail(e)
    return text


def any_process_by_service(flag: bool) -> bool:
    """`any_process` through the coordination service's key-value store, for the checks made before the
    processes are known to agree (a device collective assumes as many devices on each)."""
    ctx = context()
    if ctx.mode != XLA or ctx.size < 2:
        return any_process(flag)
    client, key = _next_exchange("any")
    try:
        client.key_value_set(f"{key}/{ctx.rank}", "1" if flag else "0")
        # every flag read before any answer: a barrier too (process 0 then removes its marker file)
        flags = [client.blocking_key_value_get(f"{key}/{r}", _BROADCAST_WAIT_MS) for r in range(ctx.size)]
        return "1" in flags
    except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
        fail(e)


def gather_text(text: str) -> list[str]:
    """Every process's `text`, in rank order, on every process (one process: [text]); through the
    coordination service's key-value store, so a device collective left half-met can't mix it up."""
    ctx = context()
    if ctx.mode == MPI:
        return list(mpi_world().allgather(text))
    if ctx.mode != XLA or ctx.size < 2:
        return [text]
    client, key = _next_exchange("gather")
    try:
        client.key_value_set(f"{key}/{ctx.rank}", text)
        return [client.blocking_key_value_get(f"{key}/{r}", _BROADCAST_WAIT_MS) for r in range(ctx.size)]
    except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
        fail(e)


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any of them (one process: `flag`)."""
    ctx = context()
    if ctx.mode == MPI:
        from mpi4py import MPI as _MPI

        return bool(mpi_world().allreduce(int(flag), op=_MPI.MAX))
    import jax

    if jax.process_count() > 1:  # shard's global mesh, or jax.distributed started by the caller
        from jax.experimental import multihost_utils

        return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))
    return flag


def sync(name: str) -> None:
    """Every process waits here for the others (e.g. after process 0 changed shared files)."""
    ctx = context()
    if ctx.mode == MPI:
        mpi_world().Barrier()
        return
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"shard_{name}")
