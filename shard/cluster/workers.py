"""The worker processes of one start of an elastic job, on an engine that exists: local processes on this
machine (`local`), one `srun` job step inside a SLURM allocation (`srun`), or one `mpiexec` (`mpiexec`).
A job is started whole, watched until it ends, asked to stop at its next step boundary (SIGTERM: the
preemption path saves and stops every process after the same step), or killed.

What each worker ended with is an exit code per process (`local`), or the launcher's one code and the
processes the others named lost (every engine: a worker that finds processes lost writes them into the
job's status folder, shard.cluster.runtime.note_lost)."""

import functools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shard.paths import read_json_or_empty
from shard.processes import die_with_parent

STATUS_ENV = "SHARD_LAUNCH_STATUS"  # the folder where the workers of one start say who they are and who was lost
ENGINES = ("local", "srun", "mpiexec")
EXIT_USER_ERROR = 2


@dataclass
class Ended:
    """How a start ended: `codes` by process (None: still running, then killed by the supervisor),
    `lost` the processes found lost (by their exit or by the others' word), `user_error` whether a worker
    stopped on the user's error (never retried)."""

    codes: dict[int, int | None] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)
    user_error: bool = False


class Job:
    """One start: `argv(i)` is process i's command line; `hosts[i]` where it runs (`local`: a label)."""

    def __init__(self, engine: str, argvs: list[list[str]], hosts: list[str], status: Path, env: dict):
        self.engine, self.hosts, self.status = engine, hosts, status
        status.mkdir(parents=True, exist_ok=True)
        for stale in status.glob("*.json"):
            stale.unlink()
        env = {**env, STATUS_ENV: str(status)}
        self.exit_order: list[int] = []  # processes (local) in the order they were seen to exit
        orphaned = functools.partial(die_with_parent, os.getpid())  # a killed supervisor leaves no workers
        if engine == "local":
            self.procs = [subprocess.Popen(argv, env=env, preexec_fn=orphaned) for argv in argvs]
        else:
            self.procs = [subprocess.Popen(_launcher_argv(engine, argvs[0], hosts), env=env, preexec_fn=orphaned)]

    def poll(self) -> list[int | None]:
        codes = [p.poll() for p in self.procs]
        self.exit_order += [i for i, c in enumerate(codes) if c is not None and i not in self.exit_order]
        return codes

    def running(self) -> bool:
        return any(c is None for c in self.poll())

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def kill_one(self, process: int) -> None:
        """SIGKILL one worker (its host is gone); the srun and mpiexec engines have no handle on one."""
        if self.engine == "local":
            self.procs[process].kill()

    def stop_at_step_boundary(self) -> None:
        """SIGTERM: every worker finishes its step, saves and stops, after the same step."""
        self.signal(signal.SIGTERM)

    def kill(self, grace_s: float = 2.0) -> None:
        """Stop what still runs: SIGTERM, then SIGKILL after `grace_s` (a worker stuck in a collective with
        a lost peer would otherwise wait out its failure timeout)."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def ended(self) -> Ended:
        """How the finished (or killed) start ended."""
        codes = dict(enumerate(self.poll())) if self.engine == "local" else {}
        named = sorted({r for f in self.status.glob("lost-*.json") for r in read_json_or_empty(f).get("lost", [])})
        if self.engine == "local":
            # the others' word, else the first to die (a signal, a crash; exit 3: it saw another one lost):
            # those after it stopped because of it, however they ended
            died = [i for i in self.exit_order if codes[i] not in (0, EXIT_USER_ERROR, 3)]
            lost = named or died[:1] or [i for i in self.exit_order if codes[i] not in (0, None)][:1]
        else:
            code = self.procs[0].poll()
            codes = dict.fromkeys(range(len(self.hosts)), code)
            lost = named or ([] if code in (0, EXIT_USER_ERROR) else [len(self.hosts) - 1])
        # a worker's own error (and the others, who heard it, stop with its code too): never retried
        return Ended(codes, lost, EXIT_USER_ERROR in codes.values())


def _launcher_argv(engine: str, argv: list[str], hosts: list[str]) -> list[str]:
    """One srun step or one mpiexec over the hosts' slots (argv: a worker's command, without cluster flags:
    the launcher's environment names each process)."""
    n = len(hosts)
    nodes = list(dict.fromkeys(hosts))
    if engine == "srun":
        return ["srun", f"--ntasks={n}", f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}",
                "--kill-on-bad-exit=1", "--overcommit", *argv]
    return ["mpiexec", "-n", str(n), *(["-hosts", ",".join(nodes)] if nodes != ["localhost"] else []), *argv]


def worker_command() -> list[str]:
    """How a worker is started: this Python, shard's CLI (-P: never code from the working folder first)."""
    return [sys.executable, "-P", "-m", "shard"]


def say_who_i_am(rank: int) -> None:
    """A worker of a launched job writes its rank, pid and host into the status folder, so the supervisor
    can name a process's host (and a test kill one)."""
    folder = os.environ.get(STATUS_ENV)
    if folder:
        import socket

        _write(Path(folder) / f"process-{rank}.json", {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()})


def note_lost(rank: int, missing: list[int]) -> None:
    """A worker that finds processes lost names them in the status folder (the supervisor of srun and
    mpiexec jobs sees one exit code only)."""
    folder = os.environ.get(STATUS_ENV)
    if folder:
        _write(Path(folder) / f"lost-{rank}.json", {"by": rank, "lost": missing})


def _write(path: Path, doc: dict) -> None:
    try:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError:
        pass  # the status is a courtesy to the supervisor: never a reason to fail training
