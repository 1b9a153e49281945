"""This process's place in a job of several processes (hosts): joining the job, the Context the rest of
shard reads, stopping when a process is lost or this one fails (with a watchdog), and leaving at the
end. It reads JAX's private API (`jax._src`) only through shard.cluster.jax_private, so that a JAX
release that moves it is met in one place.

One process per host owns that host's devices. Two ways to cross hosts:
- `xla` (default): `jax.distributed` joins the processes into one runtime; the mesh spans every device
  and XLA's collectives cross hosts (NCCL on GPUs, gloo on CPU).
- `mpi`: each process runs an SPMD program over its own devices only; gradients and metrics cross
  hosts through mpi4jax over an MPI communicator (see shard/training/bridge.py).

The CLI calls `start()` before JAX's backends start (the launcher's view is shard.cluster.launch's,
the connection itself shard.cluster.join's); the rest of shard asks `context()` for the rank, the
process count and the mode, as Horovod's `hvd.rank()` does. Values between the processes:
shard.cluster.exchange; groups of them: shard.cluster.process_sets.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field

from shard.cluster.coordinator import ServiceHandle
from shard.cluster.jax_private import backends_started, jax_distributed_module, service_client
from shard.cluster.join import JoinStuck, connect
from shard.cluster.launch import ClusterSpec
from shard.cluster.mpi import mpi_world
from shard.cluster.workers import note_lost, say_who_i_am
from shard.config.train import CROSS_HOST_MODES
from shard.errors import ShardError, first_line

XLA, MPI = CROSS_HOST_MODES
EXIT_LOST_PROCESS = 3  # exit code of a process that stops because another one was lost
_ERROR_PREFIX = "shard/error/"
_ERROR_KEY = _ERROR_PREFIX + "{rank}"  # coordination-service key: "CODE why" process `rank` stopped


@dataclass
class Context:
    """This process's place in the job (a single process unless `start()` joined a cluster)."""

    mode: str = "single"  # "single" | XLA | MPI
    rank: int = 0
    size: int = 1
    failure_timeout: float = 60.0
    _watchdog: _Watchdog | None = None
    sets: dict = field(default_factory=dict)  # name -> shard.cluster.process_sets.ProcessSet
    exchanges: int = 0  # service exchanges made so far (shard.cluster.exchange): the next one's key

    @property
    def is_main(self) -> bool:
        """Process 0: it prints, and it alone changes shared files (renames, deletions). In a single
        process of shard's, JAX's process index decides too: a caller may have started jax.distributed
        without shard (asking JAX starts its backends where nothing did yet)."""
        return self.rank == 0 and (self.mode != "single" or _jax_process_index() == 0)


_ctx = Context()
_expected: tuple[ClusterSpec, str, float, float, str] | None = None  # expect(): to join, and how
_join_stuck = False  # a join that was given up still waits inside the runtime
_stopping = threading.Lock()  # held by the thread that stops this process (_stop_once)
_stopper: int | None = None  # that thread's id


def context() -> Context:
    return _ctx


def expect(cluster: ClusterSpec | None, cross_host: str = XLA, failure_timeout: float = 60.0,
           join_timeout: float = 300.0, bind: str = "auto") -> None:
    """Note the cluster this process is about to join (None: one process, or forget it). A process
    that stops on an error of its own before joining then still reaches the others
    (`leave_on_error`), who would otherwise wait for it until the join timeout and stop without
    knowing why."""
    global _expected
    _expected = (cluster, cross_host, failure_timeout, join_timeout, bind) if cluster is not None else None


def start(cluster: ClusterSpec | None, cross_host: str = XLA, failure_timeout: float = 60.0,
          join_timeout: float = 300.0, bind: str = "auto") -> Context:
    """Join the cluster (before JAX's backends start) and return the context; one process: no-op.

    A ShardError from a join that did not complete within `join_timeout` leaves the runtime waiting in
    a thread, to abort the process natively later: exit after it (leave_on_error does)."""
    global _ctx, _expected, _join_stuck
    _expected = None  # from here on, an error is this join's own (or later): it is not joined again
    if cross_host not in CROSS_HOST_MODES:
        raise ShardError(f"--cross-host must be one of {', '.join(CROSS_HOST_MODES)}, got {cross_host!r}")
    if cluster is None:
        _ctx = Context(failure_timeout=failure_timeout)
        return _ctx
    if cluster.launcher == "mpi":  # both modes join through MPI first: mixed, they would wait on each other
        modes = mpi_world(bind).allgather(cross_host)  # MPI starts: its own sockets where cluster.bind says
        if len(set(modes)) > 1:
            raise ShardError("the processes were started with different --cross-host (" + ", ".join(
                f"process {r}: {m}" for r, m in enumerate(modes)) + "); start every process with the same command")
    if cross_host == MPI:
        comm = mpi_world(bind)
        if cluster.launcher == "explicit" or comm.Get_size() != cluster.num_processes:
            raise ShardError(f"--cross-host mpi needs an MPI launcher (mpiexec, or srun with an MPI plugin); "
                             f"MPI sees {comm.Get_size()} process(es) but the job has {cluster.num_processes}")
        _ctx = Context(MPI, comm.Get_rank(), comm.Get_size(), failure_timeout)
        say_who_i_am(_ctx.rank)
        return _ctx
    import jax

    try:
        connect(cluster, failure_timeout, join_timeout, bind)
    except JoinStuck:
        _join_stuck = True  # leave_on_error exits at once
        raise
    from shard.cluster import gloo

    gloo.drop_banner()  # gloo connects (and prints) once the CPU backend starts
    _ctx = Context(XLA, jax.process_index(), jax.process_count(), failure_timeout)
    _ctx._watchdog = _Watchdog(_ctx.size, failure_timeout)
    _ctx._watchdog.start()
    say_who_i_am(_ctx.rank)  # to a supervisor (shard launch), if one started this process
    if _ctx.size != cluster.num_processes:  # the coordinator's count won the join; the others hear why
        raise ShardError(f"process {cluster.process_id} was started for a job of {cluster.num_processes} processes, "
                         f"but joined one of {_ctx.size}; start every process with the same --num-processes")
    return _ctx


def finish() -> None:
    """Leave the cluster together: a barrier (bounded by the failure timeout), then shutdown."""
    global _ctx
    ctx = _ctx
    if ctx.mode == XLA:
        import jax

        ctx._watchdog.stop()
        client = service_client()
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
        mpi_world().Barrier()
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
    if _ctx._watchdog:
        _ctx._watchdog.stop()
    _stop_once()
    try:
        with contextlib.suppress(Exception):  # the service is gone: the others will see a lost process only
            service_client().key_value_set(_ERROR_KEY.format(rank=_ctx.rank), f"{code} {message[:500]}",
                                           allow_overwrite=True)
            _leave_service()
    finally:
        os._exit(code)


def _stop_helper_service() -> None:
    """Process 0 after a join it gave up: stop its coordination service's helper, which would otherwise
    serve on (and hold the port) for twice the failure timeout. At once: the join never completed, so
    no process has a reply to wait for (a graceful stop waited seconds on this process's own client)."""
    service = getattr(jax_distributed_module().global_state, "service", None)
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
    if _ctx.rank == 0 and _ctx._watchdog:
        _wait_for_the_others_to_leave(_ctx)
    _bounded(jax_distributed_module().shutdown)  # the client, and on process 0 the service


def _wait_for_the_others_to_leave(ctx: Context) -> None:
    """Process 0, before it stops the service: until every other process has left it (or the service
    is gone), at most the failure timeout."""
    others = set(range(1, ctx.size))
    ctx._watchdog.wait_until(lambda missing: others <= set(missing) or missing == [0], ctx.failure_timeout)


def _join_to_leave(code: int) -> None:
    """Join the expected cluster only to leave it (leave_on_error); exit `code` when that fails."""
    cluster, cross_host, failure_timeout, join_timeout, bind = _expected
    if cluster.launcher == "mpi" or cross_host == MPI:
        with contextlib.suppress(ShardError):  # no mpi4py: nothing to tell the others with
            _mpi_abort(code)
        os._exit(code)
    sys.stderr.write(f"waiting up to {join_timeout:g}s for the other {cluster.num_processes - 1} process(es) to "
                     "join, to tell them why this one stops\n")
    try:
        start(cluster, XLA, failure_timeout, join_timeout, bind)
    except BaseException:  # noqa: BLE001 - this process is stopping on its own error already
        sys.stderr.flush()
        os._exit(code)


def _mpi_abort(code: int) -> None:
    time.sleep(0.5)  # the launcher forwards this rank's error line before the abort tears the job down
    mpi_world().Abort(code)


def _stop_on_lost(missing: list[int], otherwise: str) -> None:
    """Stop with 'lost process 1 of 2 (why)': the reason a lost process left (leave_on_error), else
    `otherwise`. When every lost process left one, exit with its code (2: the job stopped on a user's
    error, which a restart would meet again), else EXIT_LOST_PROCESS."""
    reasons, codes = [], set()
    for rank in missing:
        try:
            left = service_client().key_value_try_get(_ERROR_KEY.format(rank=rank))
        except Exception:  # noqa: BLE001 - none left (a crash or a kill), or the service is gone
            continue
        code, _, reason = left.partition(" ")
        if not code.isdigit():  # left without a code (an older shard)
            code, reason = str(EXIT_LOST_PROCESS), left
        reasons.append(f"process {rank} stopped on: {reason}")
        codes.add(int(code))
    code = codes.pop() if len(reasons) == len(missing) and len(codes) == 1 else EXIT_LOST_PROCESS
    if code == EXIT_LOST_PROCESS:  # to a supervisor (shard launch): not a process that left its own error
        note_lost(_ctx.rank, missing)
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
        _wait_for_exit()


def _wait_for_exit() -> None:
    """Block this thread until the thread that is stopping the process exits it."""
    threading.Event().wait()


def _stop_once() -> None:
    """The first thread to stop this process goes on; another (the watchdog and the main thread may
    both find a lost process) waits here for its exit, so one line is printed."""
    global _stopper
    if not _stopping.acquire(blocking=False):
        _wait_for_exit()
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
        client = service_client()
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


def _jax_process_index() -> int:
    if "jax" not in sys.modules:  # then nothing started jax.distributed in this process
        return 0
    import jax

    return jax.process_index()


def jax_started() -> bool:
    """Whether JAX's backends have started: XLA reads its flags and the CPU device count then, and a
    cluster must be joined before."""
    if "jax" not in sys.modules:
        return False
    return backends_started()
