"""Several processes (hosts) as one job: start-up (the launcher's view is shard.cluster.launch's), a watchdog
for lost processes, exchanges between the processes, MPI, and Horovod-style process sets.

One process per host owns that host's devices. Two ways to cross hosts:
- `xla` (default): `jax.distributed` joins the processes into one runtime; the mesh spans every device
  and XLA's collectives cross hosts (NCCL on GPUs, gloo on CPU).
- `mpi`: each process runs an SPMD program over its own devices only; gradients and metrics cross
  hosts through mpi4jax over an MPI communicator (see shard/train/bridge.py).

The CLI calls `start()` before JAX's backends start; the rest of shard asks `context()` for the rank,
the process count and the mode, as Horovod's `hvd.rank()` does.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from shard.cluster.launch import ClusterSpec
from shard.config.train import CROSS_HOST_MODES
from shard.cluster.coordinator import ServiceHandle, service_in_helper, split_address
from shard.errors import ShardError, first_line

XLA, MPI = CROSS_HOST_MODES
EXIT_LOST_PROCESS = 3  # exit code of a process that stops because another one was lost
_ERROR_PREFIX = "shard/error/"
_ERROR_KEY = _ERROR_PREFIX + "{rank}"  # coordination-service key: "CODE why" process `rank` stopped
STARTUP_TIMEOUT = 1800.0  # seconds live processes may wait for each other to connect and compile
_JOIN_GRACE = 10.0  # seconds past the join timeout before the runtime's own deadline (a native abort)
_JOIN_NOTICE_AFTER = 10.0  # seconds of waiting to join before process 0 says it waits

@dataclass
class Context:
    """This process's place in the job (a single process unless `start()` joined a cluster)."""

    mode: str = "single"  # "single" | XLA | MPI
    rank: int = 0
    size: int = 1
    failure_timeout: float = 60.0
    _watchdog: _Watchdog | None = None
    _sets: dict[str, ProcessSet] = field(default_factory=dict)
    _exchanges: int = 0  # broadcast_text / any_process_by_service calls so far: their keys in the service

    @property
    def is_main(self) -> bool:
        """Process 0 prints and writes the run's files."""
        return self.rank == 0


_ctx = Context()
_expected: tuple[ClusterSpec, str, float, float] | None = None  # expect(): to join, and how
_join_stuck = False  # a join that was given up still waits inside the runtime
_stopping = threading.Lock()  # held by the thread that stops this process (_stop_once)
_stopper: int | None = None  # that thread's id


def context() -> Context:
    return _ctx


def expect(cluster: ClusterSpec | None, cross_host: str = XLA, failure_timeout: float = 60.0,
           join_timeout: float = 300.0) -> None:
    """Note the cluster this process is about to join (None: one process, or forget it). A process
    that stops on an error of its own before joining then still reaches the others
    (`leave_on_error`), who would otherwise wait for it until the join timeout and stop without
    knowing why."""
    global _expected
    _expected = (cluster, cross_host, failure_timeout, join_timeout) if cluster is not None else None


def start(cluster: ClusterSpec | None, cross_host: str = XLA, failure_timeout: float = 60.0,
          join_timeout: float = 300.0) -> Context:
    """Join the cluster (before JAX's backends start) and return the context; one process: no-op.

    A ShardError from a join that did not complete within `join_timeout` leaves the runtime waiting in
    a thread, to abort the process natively later: exit after it (leave_on_error does)."""
    global _ctx, _expected
    _expected = None  # from here on, an error is this join's own (or later): it is not joined again
    if cross_host not in CROSS_HOST_MODES:
        raise ShardError(f"--cross-host must be one of {', '.join(CROSS_HOST_MODES)}, got {cross_host!r}")
    if cluster is None:
        _ctx = Context(failure_timeout=failure_timeout)
        return _ctx
    if cluster.launcher == "mpi":  # both modes join through MPI first: mixed, they would wait on each other
        modes = _mpi_world().allgather(cross_host)
        if len(set(modes)) > 1:
            raise ShardError("the processes were started with different --cross-host (" + ", ".join(
                f"process {r}: {m}" for r, m in enumerate(modes)) + "); start every process with the same command")
    if cross_host == MPI:
        comm = _mpi_world()
        if cluster.launcher == "explicit" or comm.Get_size() != cluster.num_processes:
            raise ShardError(f"--cross-host mpi needs an MPI launcher (mpiexec, or srun with an MPI plugin); "
                             f"MPI sees {comm.Get_size()} process(es) but the job has {cluster.num_processes}")
        _ctx = Context(MPI, comm.Get_rank(), comm.Get_size(), failure_timeout)
        return _ctx
    import jax

    _join(cluster, failure_timeout, join_timeout)
    _ctx = Context(XLA, jax.process_index(), jax.process_count(), failure_timeout)
    _ctx._watchdog = _Watchdog(_ctx.size, failure_timeout)
    _ctx._watchdog.start()
    if _ctx.size != cluster.num_processes:  # the coordinator's count won the join; the others hear why
        raise ShardError(f"process {cluster.process_id} was started for a job of {cluster.num_processes} processes, "
                         f"but joined one of {_ctx.size}; start every process with the same --num-processes")
    return _ctx


def _join(cluster: ClusterSpec, failure_timeout: float, join_timeout: float) -> None:
    """`jax.distributed.initialize`, waited for at most the join timeout. The runtime's own deadline
    ends in a native abort (a C++ check failure, exit 134), so the join runs in a thread and the
    runtime's deadline comes later (`_JOIN_GRACE`): this one gives up first, with a ShardError; Ctrl-C
    also ends the wait."""
    global _join_stuck
    import jax

    # Recoverable tasks: a lost process no longer aborts every other one from inside the runtime, so
    # the watchdog can stop them with an error that names it.
    jax.config.update("jax_enable_recoverability", True)
    if cluster.launcher == "mpi":
        _mpi_world()  # MPI starts in this thread, the one that makes the later MPI calls
    outcome: list[BaseException | None] = []

    def connect():
        try:
            with service_in_helper():  # process 0's service outlives process 0, so its loss is reported
                _initialize(cluster, join_timeout, max(1, int(failure_timeout)))
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(e)

    joining = threading.Thread(target=connect, name="shard-join", daemon=True)
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
        _join_stuck = True
        raise ShardError(f"interrupted while joining {where}") from None
    if not outcome:
        _join_stuck = True  # the runtime still waits in that thread: leave_on_error exits at once
        raise ShardError(f"could not join {where}: not every process connected within {join_timeout:g}s (one may "
                         "have stopped on an error before joining, or not have started); cluster.join_timeout "
                         "sets the wait")
    error = outcome[0]
    if isinstance(error, RuntimeError | ValueError) and not isinstance(error, ShardError):  # XlaRuntimeError too
        raise ShardError(f"could not join {where}: {first_line(error)}") from None
    if error is not None:
        raise error


def _initialize(cluster: ClusterSpec, join_timeout: float, heartbeat_timeout: int) -> None:
    import jax

    # The runtime's deadline comes after _join's, so that _join reports a join that never completes.
    kwargs = {"initialization_timeout": int(join_timeout + 2 * _JOIN_GRACE),
              "heartbeat_timeout_seconds": heartbeat_timeout}
    if cluster.launcher == "explicit":
        if cluster.process_id != 0:
            _wait_for_coordinator(cluster.coordinator, join_timeout)
        else:  # it serves on every interface, but the others dial this name: it must resolve
            _check_resolves(cluster.coordinator)
        jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id,
                                   cluster_detection_method="deactivate", **kwargs)
    elif cluster.launcher == "mpi":
        # Under mpiexec, initialize() without arguments finds no coordinator; mpi4py's detection
        # has rank 0 pick a free port and broadcast it.
        _mpi_world()
        jax.distributed.initialize(cluster_detection_method="mpi4py", **kwargs)
    else:
        jax.distributed.initialize(**kwargs)  # SLURM: JAX reads the step's node list and task ids


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


def barrier(name: str, timeout: float = STARTUP_TIMEOUT) -> None:
    """Wait until every process gets here (a live but slow one up to `timeout`; a lost one is reported
    by the watchdog within the failure timeout).

    Before the first cross-process computations: gloo's rendezvous gives up after a fixed 30 s, and
    one process can reach it that much later than another when compiling on a busy machine.
    """
    ctx = _ctx
    if ctx.mode == XLA:
        from jax._src import distributed as jax_distributed

        try:
            jax_distributed.global_state.client.wait_at_barrier(f"shard_{name}", int(timeout * 1000))
        except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
            fail(e)
    elif ctx.mode == MPI:
        _mpi_world().Barrier()


def finish() -> None:
    """Leave the cluster together: a barrier (bounded by the failure timeout), then shutdown."""
    global _ctx
    ctx = _ctx
    if ctx.mode == XLA:
        import jax
        from jax._src import distributed as jax_distributed

        ctx._watchdog.stop()
        client = jax_distributed.global_state.client
        try:
            client.wait_at_barrier("shard_finish", int(ctx.failure_timeout * 1000))
        except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
            _lost(f"not every process reached the end of the run within {ctx.failure_timeout:g}s "
                  f"({first_line(e)})")
        if ctx.rank == 0:
            # Process 0 owns the coordination service (shard.cluster.coordinator): let the others disconnect
            # before it stops, or their own shutdown fails and aborts them.
            _wait_for_the_others_to_leave(ctx)
        jax.distributed.shutdown()
    elif ctx.mode == MPI:
        _mpi_world().Barrier()
    _ctx = Context()


def fail(error: BaseException) -> None:
    """A runtime error in a multi-process run: name the lost process if there is one, and stop this one.

    A peer that dies inside a collective makes gloo/NCCL fail here before the coordination service has
    noticed, so wait (up to the failure timeout) for the service to name it. A single process re-raises.
    """
    ctx = _ctx
    if ctx.mode != XLA:
        raise error
    first = first_line(error)
    missing = ctx._watchdog.wait_until(bool, ctx.failure_timeout) if ctx._watchdog else []
    if missing:
        _stop_on_lost(missing, first)
    _lost(f"a cross-process collective failed: {first}")


def _next_exchange(kind: str):
    """(coordination-service client, this exchange's key): every process makes the exchanges in the same
    order, so the n-th one's key is the same everywhere."""
    from jax._src import distributed as jax_distributed

    key = f"shard/{kind}/{_ctx._exchanges}"
    _ctx._exchanges += 1
    return jax_distributed.global_state.client, key


_BROADCAST_WAIT_MS = 3_600_000  # a lost process 0 is the watchdog's to report, within the failure timeout


def broadcast_text(text: str) -> str:
    """Process 0's `text` on every process (e.g. the run dir it chose, its config); one process:
    unchanged."""
    if _ctx.mode == MPI:
        return _mpi_world().bcast(text, root=0)
    if _ctx.mode == XLA and _ctx.size > 1:
        # Through the coordination service's key-value store, not a device collective: that one needs
        # every process to hold as many devices, which is among what the config check is there to find.
        client, key = _next_exchange("broadcast")
        try:
            if _ctx.rank == 0:
                client.key_value_set(key, text)
                return text
            return client.blocking_key_value_get(key, _BROADCAST_WAIT_MS)
        except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
            fail(e)
    return text


def any_process_by_service(flag: bool) -> bool:
    """`any_process` through the coordination service's key-value store, for the checks made before the
    processes are known to agree (a device collective assumes as many devices on each)."""
    if _ctx.mode != XLA or _ctx.size < 2:
        return any_process(flag)
    client, key = _next_exchange("any")
    try:
        client.key_value_set(f"{key}/{_ctx.rank}", "1" if flag else "0")
        # every flag read before any answer: a barrier too (process 0 then removes its marker file)
        flags = [client.blocking_key_value_get(f"{key}/{r}", _BROADCAST_WAIT_MS) for r in range(_ctx.size)]
        return "1" in flags
    except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
        fail(e)


def gather_text(text: str) -> list[str]:
    """Every process's `text`, in rank order, on every process (one process: [text]); through the
    coordination service's key-value store, so a device collective left half-met can't mix it up."""
    if _ctx.mode == MPI:
        return list(_mpi_world().allgather(text))
    if _ctx.mode != XLA or _ctx.size < 2:
        return [text]
    client, key = _next_exchange("gather")
    try:
        client.key_value_set(f"{key}/{_ctx.rank}", text)
        return [client.blocking_key_value_get(f"{key}/{r}", _BROADCAST_WAIT_MS) for r in range(_ctx.size)]
    except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
        fail(e)


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any of them (one process: `flag`)."""
    if _ctx.mode == MPI:
        from mpi4py import MPI as _MPI

        return bool(_mpi_world().allreduce(int(flag), op=_MPI.MAX))
    import jax

    if jax.process_count() > 1:  # shard's global mesh, or jax.distributed started by the caller
        from jax.experimental import multihost_utils

        return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))
    return flag


def sync(name: str) -> None:
    """Every process waits here for the others (e.g. after process 0 changed shared files)."""
    if _ctx.mode == MPI:
        _mpi_world().Barrier()
        return
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"shard_{name}")


def is_main_process() -> bool:
    """Process 0 of the job, the one that changes shared files (renames, deletions)."""
    import jax

    return _ctx.is_main and jax.process_index() == 0


def writes_shared_files() -> bool:
    """Whether this process writes its part of shared run files (checkpoints): under the global mesh
    every process writes the shards it holds; under the MPI bridge the processes hold equal replicas,
    so process 0 writes them alone."""
    return _ctx.mode != MPI or _ctx.is_main


def leave_on_error(message: str, code: int) -> None:
    """This process stops on an error of its own (out of memory, a file missing on this host), with
    exit `code`; one process: returns (the caller exits). Several processes:
    - jax.distributed: stop the watchdog, leave `CODE message` with the coordination service (the
      others' watchdogs find it within a second, name it and stop), and exit at once. Process 0 first
      waits until the others are gone and stops the service (`_leave_service`).
    - the MPI bridge: take the whole job down, since the other ranks would otherwise wait in their next
      MPI call (and this one in MPI_Finalize) for ever.
    - not joined yet (see `expect`): join first, then leave as above; under MPI, start MPI and take
      the job down, as the others wait in MPI's start-up for this rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _join_stuck:  # the runtime still waits in a thread; an orderly exit would wait with it
        _stop_helper_service()
        os._exit(code)
    if _expected is not None:
        _join_to_leave(code)
    if _ctx.size < 2:
        return
    if _ctx.mode == MPI:
        _mpi_abort(code)
    from jax._src import distributed as jax_distributed

    if _ctx._watchdog:
        _ctx._watchdog.stop()
    _stop_once()
    try:
        with contextlib.suppress(Exception):  # the service is gone: the others will see a lost process only
            jax_distributed.global_state.client.key_value_set(_ERROR_KEY.format(rank=_ctx.rank),
                                                              f"{code} {message[:500]}", allow_overwrite=True)
            _leave_service()
    finally:
        os._exit(code)


def _stop_helper_service() -> None:
    """Process 0 after a join it gave up: stop its coordination service's helper, which would otherwise
    serve on (and hold the port) for twice the failure timeout. At once: the join never completed, so
    no process has a reply to wait for (a graceful stop waited seconds on this process's own client)."""
    from jax._src import distributed as jax_distributed

    service = getattr(jax_distributed.global_state, "service", None)
    if isinstance(service, ServiceHandle):
        service.stop_now()


def _bounded(fn, seconds: float = 5.0) -> None:
    """fn() in a daemon thread, waited for at most `seconds`: a call into a service that may be gone."""
    def call():
        with contextlib.suppress(Exception):
            fn()

    thread = threading.Thread(target=call, name="shard-bounded-call", daemon=True)
    thread.start()
    thread.join(seconds)


def _leave_service() -> None:
    """On the way out of a failed run. Process 0 waits, up to the failure timeout, until the others
    have left, then stops the coordination service (its helper), so that a rerun on the same port
    meets no stale one. Another process disconnects, so that the others see it gone at once rather
    than after the heartbeat timeout."""
    from jax._src import distributed as jax_distributed

    if _ctx.rank == 0 and _ctx._watchdog:
        _wait_for_the_others_to_leave(_ctx)
    _bounded(jax_distributed.shutdown)  # the client, and on process 0 the service


def _wait_for_the_others_to_leave(ctx: Context) -> None:
    """Process 0, before it stops the service: until every other process has left it (or the service
    is gone), at most the failure timeout."""
    others = set(range(1, ctx.size))
    ctx._watchdog.wait_until(lambda missing: others <= set(missing) or missing == [0], ctx.failure_timeout)


def _join_to_leave(code: int) -> None:
    """Join the expected cluster only to leave it (leave_on_error); exit `code` when that fails."""
    cluster, cross_host, failure_timeout, join_timeout = _expected
    if cluster.launcher == "mpi" or cross_host == MPI:
        with contextlib.suppress(ShardError):  # no mpi4py: nothing to tell the others with
            _mpi_abort(code)
        os._exit(code)
    sys.stderr.write(f"waiting up to {join_timeout:g}s for the other {cluster.num_processes - 1} process(es) to "
                     "join, to tell them why this one stops\n")
    try:
        start(cluster, XLA, failure_timeout, join_timeout)
    except BaseException:  # noqa: BLE001 - this process is stopping on its own error already
        sys.stderr.flush()
        os._exit(code)


def _mpi_abort(code: int) -> None:
    time.sleep(0.5)  # the launcher forwards this rank's error line before the abort tears the job down
    _mpi_world().Abort(code)


def _stop_on_lost(missing: list[int], otherwise: str) -> None:
    """Stop with 'lost process 1 of 2 (why)': the reason a lost process left (leave_on_error), else
    `otherwise`. When every lost process left one, exit with its code (2: the job stopped on a user's
    error, which a restart would meet again), else EXIT_LOST_PROCESS."""
    from jax._src import distributed as jax_distributed

    reasons, codes = [], set()
    for rank in missing:
        try:
            left = jax_distributed.global_state.client.key_value_try_get(_ERROR_KEY.format(rank=rank))
        except Exception:  # noqa: BLE001 - none left (a crash or a kill), or the service is gone
            continue
        code, _, reason = left.partition(" ")
        if not code.isdigit():  # left without a code (an older shard)
            code, reason = str(EXIT_LOST_PROCESS), left
        reasons.append(f"process {rank} stopped on: {reason}")
        codes.add(int(code))
    code = codes.pop() if len(reasons) == len(missing) and len(codes) == 1 else EXIT_LOST_PROCESS
    _lost(f"lost process {', '.join(map(str, missing))} of {_ctx.size} ({'; '.join(reasons) or otherwise})", code)


def _lost(reason: str, code: int = EXIT_LOST_PROCESS) -> None:
    """Stop this process at once with a one-line error (threads may be stuck inside a collective)."""
    _stop_once()
    try:
        with contextlib.suppress(OSError):  # stderr closed: stop all the same
            sys.stderr.write(f"error: {reason}; stopping process {_ctx.rank}\n")
            sys.stderr.flush()
        _leave_service()
    finally:
        os._exit(code)


def wait_if_stopping() -> None:
    """If another thread is stopping this process (it found a process lost, or this one failed), wait
    for it to exit: an error in this thread is then a consequence (a collective cut short), not news."""
    if _stopping.locked() and _stopper != threading.get_ident():
        threading.Event().wait()


def _stop_once() -> None:
    """The first thread to stop this process goes on; another (the watchdog and the main thread may
    both find a lost process) waits here for its exit, so one line is printed."""
    global _stopper
    if not _stopping.acquire(blocking=False):
        threading.Event().wait()
    _stopper = threading.get_ident()


class _Watchdog:
    """Polls the coordination service for the live processes; a missing one stops this process.

    The service marks a process dead when its connection closes or it misses heartbeats for the
    failure timeout, so a crashed or hung peer is reported within that bound instead of leaving the
    others blocked in a collective forever.
    """

    def __init__(self, size: int, timeout: float, interval: float = 1.0):
        self.size, self.timeout, self.interval = size, timeout, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def missing(self) -> list[int]:
        """Processes the coordination service no longer counts as live, or that left the reason they
        stop (leave_on_error); [0] when the service is unreachable."""
        from jax._src import distributed as jax_distributed

        client = jax_distributed.global_state.client
        try:
            live = client.get_live_nodes(list(range(self.size)))
            left = {int(key.rpartition("/")[2]) for key, _ in client.key_value_dir_get(_ERROR_PREFIX)}
        except Exception:  # noqa: BLE001 - the coordinator (process 0) is gone
            return [0]
        return sorted((set(range(self.size)) - set(live) | left) - {_ctx.rank})

    def wait_until(self, done, timeout: float) -> list[int]:
        """Poll the missing processes until `done(missing)` holds or `timeout` passes; the last answer."""
        end = time.monotonic() + timeout
        while True:
            missing = self.missing()
            if done(missing) or time.monotonic() > end:
                return missing
            time.sleep(0.1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            missing = self.missing()
            if missing and not self._stop.is_set():
                _stop_on_lost(missing, f"it exited, or sent no heartbeat for {self.timeout:g}s")


# --- MPI -------------------------------------------------------------------------------------------

def _mpi_world():
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


# --- Process sets ----------------------------------------------------------------------------------

class ProcessSet:
    """A named group of processes, as in Horovod: a sub-mesh over its members' devices and, where MPI
    runs, a sub-communicator. Collectives on a set involve its members only; non-members skip them.

    Create with `process_set(ranks)` on every process (non-members get a handle that says so), destroy
    with `.destroy()`; a destroyed set raises ShardError when used.
    """

    def __init__(self, name: str, ranks: Sequence[int], ctx: Context):
        self.name, self.ranks, self._ctx = name, tuple(ranks), ctx
        self._alive = True
        self._comm = None
        if ctx.mode == MPI or (ctx.mode != "single" and mpi_available()):
            world = _mpi_world()
            # MPI_Comm_create_group is collective over the members only.
            group = world.Get_group().Incl(list(self.ranks))
            self._comm = world.Create_group(group) if self.includes(ctx.rank) else None
            group.Free()

    def __repr__(self) -> str:
        state = "" if self._alive else ", destroyed"
        return f"ProcessSet({self.name!r}, ranks={list(self.ranks)}{state})"

    def includes(self, rank: int | None = None) -> bool:
        """Whether `rank` (default: this process) is a member."""
        return (self._ctx.rank if rank is None else rank) in self.ranks

    @property
    def rank(self) -> int:
        """This process's position in the set (0 is the set's leader)."""
        self._check()
        return self.ranks.index(self._ctx.rank)

    @property
    def size(self) -> int:
        self._check()
        return len(self.ranks)

    @property
    def comm(self):
        """The MPI sub-communicator (members only)."""
        self._check()
        if self._comm is None:
            raise ShardError(f"process set {self.name!r} has no MPI communicator here "
                             "(MPI is not running, or this process is not a member)")
        return self._comm

    def devices(self) -> list:
        """The devices of the member processes (with the MPI bridge, each process sees only its own)."""
        self._check()
        import jax

        if self._ctx.mode == XLA:
            return [d for d in jax.devices() if d.process_index in self.ranks]
        return list(jax.local_devices())

    def mesh(self, spec: str = "data=-1"):
        """A shard mesh (any `--mesh` spec) over the members' devices, processes on the outer axes."""
        from shard.sharding.mesh import build_mesh, parse_mesh

        self._check()
        return build_mesh(parse_mesh(spec), sorted(self.devices(), key=lambda d: (d.process_index, d.id)))

    def allreduce(self, x) -> np.ndarray:
        """The sum of `x` (a host array or scalar) over the members; every member gets it."""
        self._check()
        if not self.includes():
            raise ShardError(f"process {self._ctx.rank} is not a member of process set {self.name!r} "
                             f"(ranks {list(self.ranks)})")
        x = np.asarray(x)
        if self._ctx.mode == "single":
            return x.copy()
        if self._comm is not None:
            out = np.empty_like(x)
            self._comm.Allreduce(np.ascontiguousarray(x), out)
            return out
        return self._xla_allreduce(x)

    def _xla_allreduce(self, x: np.ndarray) -> np.ndarray:
        """One row per member on the set's own devices (first local device of each member), summed
        by an XLA program that only the members run."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

        firsts = {}
        for d in sorted(self.devices(), key=lambda d: d.id):
            firsts.setdefault(d.process_index, d)
        mesh = Mesh(np.array([firsts[r] for r in sorted(firsts)]), ("procs",), axis_types=(AxisType.Auto,))
        rows = jax.make_array_from_callback((len(firsts), *x.shape), NamedSharding(mesh, PartitionSpec("procs")),
                                            lambda index: x[None])
        total = jax.jit(lambda r: jnp.sum(r, axis=0), out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)
        return np.asarray(total.addressable_data(0))

    def destroy(self) -> None:
        """Remove the set; further use raises ShardError."""
        if self._alive:
            self._alive = False
            if self._comm is not None:
                self._comm.Free()
                self._comm = None
            self._ctx._sets.pop(self.name, None)

    def _check(self) -> None:
        if not self._alive:
            raise ShardError(f"process set {self.name!r} was destroyed")


def process_set(ranks: Sequence[int], name: str | None = None, *, _compare: bool = True) -> ProcessSet:
    """Create a process set over `ranks` (call it on every process, with the same ranks: the processes
    compare them first, since MPI would wait for ever on a group its members disagree about)."""
    ctx = _ctx
    given = [int(r) for r in ranks]
    ranks = tuple(sorted(set(given)))
    if len(ranks) < len(given):
        raise ShardError(f"process set ranks repeat: {given}")
    if not ranks or ranks[0] < 0 or ranks[-1] >= ctx.size:
        raise ShardError(f"process set ranks must be in 0..{ctx.size - 1}, got {list(ranks)}")
    name = name or "ranks-" + "-".join(map(str, ranks))
    if _compare:
        asked = [json.loads(t) for t in gather_text(json.dumps([name, list(ranks)]))]
        other = next((p for p, a in enumerate(asked) if a != asked[0]), None)
        if other is not None:
            raise ShardError(f"process {other} created process set {asked[other][0]!r} over ranks {asked[other][1]}, "
                             f"process 0 {asked[0][0]!r} over {asked[0][1]}; create a set on every process with "
                             "the same ranks and name")
    if name in ctx._sets:
        raise ShardError(f"process set {name!r} already exists; destroy it first")
    ps = ProcessSet(name, ranks, ctx)
    ctx._sets[name] = ps
    return ps


def world() -> ProcessSet:
    """The set of every process (created on first use)."""
    return _ctx._sets.get("world") or process_set(range(_ctx.size), "world", _compare=False)  # alike everywhere

