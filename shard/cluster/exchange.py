"""Values between the processes of one job, one function each: a barrier, process 0's text on every
process, every process's text on every process, and whether a flag is set on any of them. One
process: each returns at once; under the MPI bridge each is MPI's.

Under jax.distributed two mechanisms cross the processes; a barrier or an any_process picks one:
- the coordination service (the default): its barrier and key-value store. It needs no devices, so
  it serves the start-up checks, made before the processes are known to hold as many devices, and a
  process lost meanwhile is named (runtime.fail). It is there only where shard joined the job
  (runtime.start); elsewhere a barrier through it returns at once and any_process takes the devices.
- a device collective (`device_collective=True`): an XLA program over every device. It also works
  under a jax.distributed that a caller started without shard, meets another device barrier (orbax
  waits in one at the end of a restore), and leaves no keys behind in the service (a check made
  every step).
"""

from __future__ import annotations

import numpy as np

from shard.cluster.jax_private import service_client
from shard.cluster.mpi import mpi_world
from shard.cluster.runtime import MPI, XLA, context, fail

STARTUP_TIMEOUT = 1800.0  # seconds live processes may wait for each other to connect and compile
_BROADCAST_WAIT_MS = 3_600_000  # a lost process 0 is the watchdog's to report, within the failure timeout


def barrier(name: str, timeout: float = STARTUP_TIMEOUT, *, device_collective: bool = False) -> None:
    """Wait until every process gets here. Through the service a live but slow process is waited for up
    to `timeout` (gloo's rendezvous gives up after a fixed 30 s, and one process can reach the first
    cross-process computation that much later than another when compiling on a busy machine); a lost
    one is reported by the watchdog within the failure timeout. As a device collective: after process 0
    changed shared files (checkpoints), and to meet orbax's barrier.
    """
    ctx = context()
    if ctx.mode == MPI:
        mpi_world().Barrier()
    elif device_collective:
        import jax

        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"shard_{name}")
    elif ctx.mode == XLA:
        try:
            service_client().wait_at_barrier(f"shard_{name}", int(timeout * 1000))
        except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
            fail(e)


def _next_exchange(kind: str):
    """(coordination-service client, this exchange's key): every process makes the exchanges in the same
    order, so the n-th one's key is the same everywhere."""
    ctx = context()
    key = f"shard/{kind}/{ctx.exchanges}"
    ctx.exchanges += 1
    return service_client(), key


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


def any_process(flag: bool, *, device_collective: bool = False) -> bool:
    """True on every process when `flag` is true on any of them (one process: `flag`). Through the
    service every flag is read before any process answers, so it is a barrier too."""
    ctx = context()
    if ctx.mode == XLA and ctx.size > 1 and not device_collective:
        return _any_in_service(flag)
    if ctx.mode == MPI:
        from mpi4py import MPI as _MPI

        return bool(mpi_world().allreduce(int(flag), op=_MPI.MAX))
    import jax

    if jax.process_count() > 1:  # shard's global mesh, or jax.distributed started by the caller
        from jax.experimental import multihost_utils

        return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))
    return flag


def _any_in_service(flag: bool) -> bool:
    ctx = context()
    client, key = _next_exchange("any")
    try:
        client.key_value_set(f"{key}/{ctx.rank}", "1" if flag else "0")
        # every flag read before any answer: a barrier too (process 0 then removes its marker file)
        flags = [client.blocking_key_value_get(f"{key}/{r}", _BROADCAST_WAIT_MS) for r in range(ctx.size)]
        return "1" in flags
    except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
        fail(e)
