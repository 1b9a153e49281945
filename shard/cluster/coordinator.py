"""The JAX coordination service in a process of its own, so that losing process 0 is an ordinary lost
process.

`jax.distributed.initialize` starts the coordination service inside process 0. When process 0 dies,
every other process's runtime sees the service's socket close and aborts natively (a C++ check
failure, exit 134) before shard can say which process was lost. Hosted by this small helper (started by
process 0, on process 0's host and address), the service outlives process 0: the others see process 0
miss its heartbeats and the watchdog stops them with the usual one-line error.

Run as `python -m shard.cluster.coordinator BIND NUM_PROCESSES HEARTBEAT_S SHUTDOWN_S PARENT_PID RECOVERABLE`
(`start_service` does). The helper serves until its parent says stop (`ServiceHandle.shutdown`: a `q`
on its stdin) or, when the parent died, for long enough that the other processes notice (twice the
heartbeat timeout, plus 5 s), then exits. It ignores SIGINT and SIGTERM and runs in a session of its
own: a Ctrl-C or a preemption signal to the job's process group is for the trainers, which finish their
step and save while the service they need stays up.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from shard.cluster.jax_private import jax_distributed_module
from shard.errors import ShardError


class ServiceHandle:
    """What `jax.distributed` keeps as its service: `shutdown()` stops the helper process."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):  # gone already
                self.proc.stdin.write(b"q")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.stop_now()

    def stop_now(self) -> None:
        """Without serving the replies in flight (nobody waits for one): the port is free on return."""
        self.proc.kill()
        self.proc.wait()


def start_service(bind_address: str, num_nodes: int, heartbeat_timeout: int = 100,
                  shutdown_timeout: int = 300, recoverable: bool = False, **_unused) -> ServiceHandle:
    """Start the helper with JAX's arguments (the signature of `get_distributed_runtime_service`)."""
    _check_port_free(bind_address)
    args = [bind_address, str(num_nodes), str(int(heartbeat_timeout)), str(int(shutdown_timeout)),
            str(os.getpid()), "1" if recoverable else "0"]
    proc = subprocess.Popen(helper_command(*args), stdin=subprocess.PIPE, env=helper_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return ServiceHandle(proc)


def helper_command(*args: str) -> list[str]:
    """The helper's command line. `-P`: the working directory is not put first on its import path, so a
    `shard/` package in the folder a job starts from (an old clone, an untrusted checkout) is never
    run in its place; `helper_env` names the folder of the shard that runs this process instead."""
    return [sys.executable, "-P", "-m", "shard.cluster.coordinator", *args]


def helper_env() -> dict[str, str]:
    """The environment with this process's own shard first on PYTHONPATH."""
    from pathlib import Path

    import shard

    root = str(Path(shard.__file__).resolve().parent.parent)
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root, *rest]))


def split_address(address: str) -> tuple[str, str]:
    """`HOST:PORT` -> (host, port text), an IPv6 host without its brackets: `[::1]:80` -> ("::1", "80")."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def _check_port_free(bind_address: str) -> None:
    """The service's port must be free: gRPC would share it with another service (say a previous
    run's, still serving for a failed run's last processes), and this job's processes could meet
    that one instead. Checked on the address the service binds ('[::]:P': every interface, IPv6 or,
    where the kernel has none, IPv4); any other failure to bind is left to the service to report."""
    host, port = split_address(bind_address)
    for address in [host] if host not in ("", "::", "0.0.0.0") else ["::", "0.0.0.0"]:
        try:
            with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed run's TIME_WAIT is no use
                s.bind((address, int(port)))
            return
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ShardError(f"the coordinator's port {port} is in use (by another job, or a previous run's "
                                 "coordination service, which serves up to twice the failure timeout after its "
                                 "process 0 is gone); choose another port (--coordinator HOST:PORT; under "
                                 "srun, JAX_COORDINATOR_PORT), or wait") from None


@contextlib.contextmanager
def service_in_helper():
    """While active, a `jax.distributed.initialize` on process 0 hosts its service in a helper process.

    Falls back to JAX's own in-process service where this jaxlib has no such entry point."""
    lib = getattr(jax_distributed_module(), "_jax", None)
    original = getattr(lib, "get_distributed_runtime_service", None)
    if original is None:
        yield
        return
    lib.get_distributed_runtime_service = start_service
    try:
        yield
    finally:
        lib.get_distributed_runtime_service = original


def main(argv: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # the trainers' signals (see the module docstring)
        signal.signal(sig, signal.SIG_IGN)
    bind, num_nodes, heartbeat, shutdown, parent, recoverable = argv
    from jaxlib import _jax  # the runtime only: no need to start JAX itself

    service = _jax.get_distributed_runtime_service(
        bind, int(num_nodes), heartbeat_timeout=int(heartbeat), shutdown_timeout=int(shutdown),
        recoverable=recoverable == "1")
    stopping = []

    def read_stop() -> None:  # `q` from ServiceHandle.shutdown; an end of file alone: the parent died
        if sys.stdin.buffer.read(1) == b"q":
            stopping.append(True)

    threading.Thread(target=read_stop, daemon=True).start()
    while os.getppid() == int(parent) and not stopping:
        time.sleep(0.2)
    if stopping:
        # Process 0 is done (`ServiceHandle.shutdown`): stop serving gracefully, so that the replies
        # still in flight (another process's disconnect) arrive before the service goes away.
        service.shutdown()
        os._exit(0)
    time.sleep(2 * int(heartbeat) + 5)  # the parent died: let the others see it miss its heartbeats
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
