"""Elastic training as one library call: `launch` supervises a training job (shard launch). It starts the
workers, each a plain `shard train --resume --allow-fresh` of the job's own arguments, watches them, and
when one is lost (killed, its host gone from discovery, exit 3) restarts the job at the largest size the
slots allow and the mesh and the global batch divide, from its newest checkpoint (or local snapshot);
when slots come back it asks the job to save at its next step and grows it. A worker's own error (exit 2)
is never retried. The global batch and the data order never change with the size: the curve is the
uninterrupted one. Every change of size is a line (`say`) and an event record in metrics.jsonl.
"""

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from shard import config as config_mod
from shard.cluster.hosts import HostSlots, allocation_slots
from shard.cluster.sizes import SizePolicy
from shard.cluster.workers import ENGINES, EXIT_USER_ERROR, Job, worker_command
from shard.errors import ShardError
from shard.observe.console import note as console_note
from shard.observe.metrics import append_event, is_event, read_jsonl, read_lines
from shard.paths import CHECKPOINTS_DIR
from shard.run.checkpoint_files import step_dirs
from shard.run.devices import Notice
from shard.sharding.mesh import parse_mesh

# The flags the supervisor gives each worker itself.
CLUSTER_FLAGS = ("--coordinator", "--num-processes", "--process-id")
EXIT_BUDGET = 3  # the restart budget is spent: a person (or a bigger budget) may mend it


@dataclass(frozen=True)
class LaunchOptions:
    """How the job may be sized and restarted (shard launch's flags)."""

    processes: int | None = None  # to start with (default: every slot, at most max_processes)
    min_processes: int = 1
    max_processes: int | None = None  # default: the processes it starts with
    devices_per_process: int | None = None  # default: the workers' --simulate-devices
    hosts_file: str | None = None
    discovery: str | None = None
    max_restarts: int = 3
    engine: str = "local"
    poll_s: float = 0.2
    discover_every_s: float = 2.0  # how often the discovery script is asked
    elastic_timeout_s: float = 600.0  # with discovery: how long to wait for enough slots after a loss


@dataclass
class _Record:
    """What the supervisor writes into metrics.jsonl, between starts only (no worker writes then)."""

    path: Path
    pending: list = field(default_factory=list)

    def add(self, event: str, at: float | None = None, **fields) -> None:
        self.pending.append({"event": event, "time": round(at or time.time(), 3), **fields})

    def flush(self) -> None:
        if self.pending:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for event in self.pending:
                append_event(self.path, event)  # on a line of its own, after a worker killed mid-line
            self.pending.clear()


def launch(train_args: list[str], settings: dict, *, config_file: str | None = None, sets: list[str] = (),
           options: LaunchOptions = LaunchOptions(), say: Notice = print, note: Notice = console_note) -> int:
    """Supervise the job `shard train TRAIN_ARGS` (whose keys are `settings`, `config_file` and `sets`, as
    run_training reads them) until it finishes; the exit code: 0 finished, 2 a worker's error or a job
    that fits no size, 3 the restart budget spent."""
    if options.engine not in ENGINES:
        raise ShardError(f"--engine must be one of {', '.join(ENGINES)}, got {options.engine!r}")
    given = [f for f in CLUSTER_FLAGS if any(a == f or a.startswith(f + "=") for a in train_args)]
    if given:
        raise ShardError(f"shard launch gives each worker its {given[0]}: leave it out of the train arguments")
    cfg = _job_config(settings, config_file, list(sets))
    devices = options.devices_per_process or cfg.mesh.simulate_devices
    if not devices:
        raise ShardError("give --devices-per-process (the accelerators each worker holds), or --simulate-devices "
                         "among the train arguments on a CPU")
    allocation = allocation_slots(os.environ) if options.engine == "srun" else []
    slots = HostSlots(hosts_file=options.hosts_file, discovery=options.discovery,
                      local=options.processes or options.max_processes or 1,
                      slots=allocation if not (options.hosts_file or options.discovery) else None)
    first = options.processes or min(len(slots.last), options.max_processes or len(slots.last))
    policy = SizePolicy.of(parse_mesh(cfg.mesh.spec), cfg.rules, devices, cfg.data.batch, cfg.data.microbatches,
                           options.min_processes, options.max_processes or first)
    return _Supervisor(train_args, cfg, policy, slots, options, say, note).run(first)


def _job_config(settings: dict, config_file: str | None, sets: list[str]):
    """The job's config as its workers resolve it (a resume, which may be its first start)."""
    from shard.run.start import resolve_start, run_dir_named

    from_file = config_mod.load_file(str(config_file)) if config_file else {}
    run_dir = run_dir_named(settings.get("run_dir"), from_file, True)
    if not run_dir:
        raise ShardError("shard launch needs --run-dir: the run its restarts continue")
    settings = {**settings, "run_dir": run_dir}
    start = resolve_start(lambda base: config_mod.layer(base, from_file, settings, sets), from_file, sets,
                          run_dir=run_dir, init_from=settings.get("init_from"), resume=True, allow_fresh=True)
    return start.cfg


class _Supervisor:
    def __init__(self, train_args, cfg, policy: SizePolicy, slots: HostSlots, options: LaunchOptions,
                 say: Notice, note: Notice):
        self.train_args, self.cfg, self.policy, self.slots = train_args, cfg, policy, slots
        self.options, self.say, self.note = options, say, note
        self.run_dir = Path(cfg.run_dir)
        self.record = _Record(self.run_dir / "metrics.jsonl")
        self.gone: list[str] = []  # slots lost without discovery to say they came back
        self.restarts = 0
        self.recoveries: list[dict] = []
        self.started = time.time()

    def run(self, first: int) -> int:
        n = self.policy.largest(min(first, len(self.usable())))
        self.record.add("launch_start", processes=n, mesh=self.policy.describe(n),
                        min_processes=self.policy.min_processes, max_processes=self.policy.max_processes)
        self.say(f"launching {n} process(es) x {self.policy.devices_per_process} device(s), "
                 f"{self.policy.describe(n)}, on {self.options.engine} ({', '.join(self.usable()[:n])})")
        change = None  # the resize this start follows, said once it trains
        while True:
            job = self._start(n)
            outcome, detail = self._watch(job, change)
            if outcome == "finished":
                return self._end("finished", 0)
            if outcome == "user error":
                return self._end("user error", EXIT_USER_ERROR)
            if outcome == "stopped":
                return self._end("stopped", 0)
            if outcome == "lost":
                self.restarts += 1
                if self.restarts > self.options.max_restarts:
                    self.say(f"{self._lost_words(detail)}: the restart budget of {self.options.max_restarts} is "
                             "spent; stopping (the same shard launch resumes the run)")
                    return self._end("restart budget", EXIT_BUDGET)
            new = self._next_size()
            if new is None:
                return self._end("no size fits", EXIT_USER_ERROR)
            change = self._resize(outcome, detail if outcome == "lost" else [], new)
            n = new

    def _next_size(self) -> int | None:
        """The size of the next start; None (said) where none fits. With discovery, slots may come back:
        wait for them up to --elastic-timeout (Horovod's), asking the script every --discovery-interval."""
        deadline = time.monotonic() + self.options.elastic_timeout_s
        waiting = False
        while True:
            try:
                return self.policy.largest(len(self.usable()))
            except ShardError as e:
                if self.slots.discovery is None or time.monotonic() >= deadline:
                    self.say(f"can't continue: {e}")
                    return None
                if not waiting:
                    self.say(f"{e}: waiting up to {self.options.elastic_timeout_s:g} s for --host-discovery to list "
                             "more")
                    waiting = True
                time.sleep(self.options.discover_every_s)

    def usable(self) -> list[str]:
        """The slots the job may use now: what there are, less those whose process was lost (a host that
        failed stays out until discovery drops it from its list and lists it again)."""
        slots = self.slots.current()
        if self.slots.discovery is not None:
            self.gone = [h for h in self.gone if h in slots]
        for host in self.gone:
            if host in slots:
                slots.remove(host)
        return slots

    def _start(self, n: int) -> Job:
        hosts = self.usable()[:n]
        base = [*worker_command(), "train", *self.train_args, "--resume", "--allow-fresh"]
        env = dict(os.environ)
        if self.options.engine == "local":
            port = _free_port()
            argvs = [base + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)]
                     for i in range(n)]
        else:  # the launcher's environment names each process; JAX derives srun's port from the job id, which
            argvs = [base]  # an earlier start's lingering service may hold: a fresh one for each start
            env["JAX_COORDINATOR_PORT"] = str(_free_port())
        self.record.flush()
        self.n, self.hosts = n, hosts
        path = self.run_dir / "metrics.jsonl"
        self.metrics_size = path.stat().st_size if path.is_file() else 0  # this start's records come after
        return Job(self.options.engine, argvs, hosts, self.run_dir / ".launch", env)

    def _watch(self, job: Job, change: dict | None) -> tuple[str, object]:
        """Until the start ends: ("finished" | "stopped" | "user error" | "lost" | "grow", detail)."""
        asked_to_stop, last_discovery, interrupted = False, time.monotonic(), False
        while True:
            try:
                codes = job.poll()
                if change is not None and self._trains_again(change):
                    change = None
                if any(c not in (None, 0) for c in codes) and not asked_to_stop:
                    return self._failed(job)
                if all(c is not None for c in codes):  # all exited 0: at --steps, or stopped as asked
                    if self._finished():
                        return "finished", None
                    return ("stopped", None) if interrupted or not asked_to_stop else ("grow", None)
                if not asked_to_stop and time.monotonic() - last_discovery >= self.options.discover_every_s:
                    last_discovery = time.monotonic()
                    verdict = self._hosts_changed(job)
                    if verdict == "lost":
                        return self._failed(job)
                    if verdict == "grow":
                        job.stop_at_step_boundary()
                        asked_to_stop = True
                time.sleep(self.options.poll_s)
            except KeyboardInterrupt:  # the workers got the Ctrl-C too: they save and stop
                interrupted = asked_to_stop = True
                self.say("interrupted: the workers save and stop")

    def _failed(self, job: Job) -> tuple[str, object]:
        time.sleep(self.options.poll_s)  # the others' word on who was lost
        job.kill()
        ended = job.ended()
        if ended.user_error:
            return "user error", None
        self.gone += self._hosts_of(ended.lost)
        self.lost_at = time.monotonic()
        return "lost", ended.lost

    def _hosts_changed(self, job: Job) -> str:
        """"lost" (a running process's host left the discovery's list: its workers are stopped), "grow"
        (more slots than the job uses, and a bigger size fits), else ""."""
        if self.slots.discovery is None:
            return ""
        now = self.slots.current()
        if self.slots.problem:
            self.note(f"host discovery: {self.slots.problem}; keeping the last list")
            return ""
        left = [i for i, h in enumerate(self.hosts) if now.count(h) < self.hosts[:i + 1].count(h)]
        if left:
            for i in left:
                job.kill_one(i)
            return "lost"
        try:
            return "grow" if self.policy.largest(len(now)) > self.n else ""
        except ShardError:
            return ""

    def _resize(self, outcome: str, lost: list[int], new: int) -> dict:
        """A change of size under way: said and recorded once the new start trains (`_trains_again`)."""
        what = self._lost_words(lost) if outcome == "lost" else f"{len(self.usable())} process slots"
        return {"what": what, "reason": outcome, "lost": lost, "hosts": self._hosts_of(lost), "processes": new,
                "since": self.lost_at if outcome == "lost" else time.monotonic(), "at": time.time(),
                "last_logged": self._last_logged()}

    def _finished(self) -> bool:
        """Whether the run has its checkpoint at --steps (the last step always saves)."""
        saved = step_dirs(self.run_dir / CHECKPOINTS_DIR)
        return bool(saved) and saved[-1] >= self.cfg.steps

    def _hosts_of(self, processes: list[int]) -> list[str]:
        return [self.hosts[i] for i in processes if i < len(self.hosts)]

    def _lost_words(self, lost: list[int]) -> str:
        """`lost process 2 (host h3)`."""
        hosts = self._hosts_of(lost)
        return f"lost process {', '.join(map(str, lost)) or '?'}" + (f" (host {', '.join(hosts)})" if hosts else "")

    def _trains_again(self, change: dict) -> bool:
        """Whether the new start has logged a step; then the change of size is said and recorded, with the
        step it resumed from (a local snapshot's, or a checkpoint's) and the steps it redoes."""
        path = self.run_dir / "metrics.jsonl"
        new = [r for r in read_lines(path, self.metrics_size)[0] if not is_event(r)] if path.is_file() else []
        if not new:
            return False
        step = int(new[0].get("start_step", 0))
        source = "checkpoint" if step in step_dirs(self.run_dir / CHECKPOINTS_DIR) else \
            "local snapshot" if step else "the start"
        redone = max(0, change["last_logged"] - step)
        seconds = time.monotonic() - change["since"]
        n = change["processes"]
        verb = "continuing on" if change["reason"] == "lost" else "growing to"
        self.say(f"{change['what']}: {verb} {n} process{'es' if n != 1 else ''}, {self.policy.describe(n)}, from step {step} ({source}, "
                 f"{redone} step{'s' if redone != 1 else ''} redone) after {seconds:.1f} s")
        self.record.add("resize", at=change["at"], step=step, reason=change["reason"], lost_processes=change["lost"],
                        hosts=change["hosts"], processes=n, mesh=self.policy.describe(n), source=source,
                        steps_redone=redone)
        self.recoveries.append({"step": step, "recovery_s": round(seconds, 1)})
        return True

    def _last_logged(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return max((int(r["step"]) for r in read_jsonl(path)), default=0) if path.is_file() else 0

    def _end(self, ended: str, code: int) -> int:
        self.record.add("launch_end", held_s=round(time.time() - self.started, 1), ended=ended,
                        restarts=self.restarts, recoveries=self.recoveries)
        self.record.flush()
        return code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
