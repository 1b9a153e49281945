"""A training run as one library call: `run_training` does what `shard train` does, from the layered config
to how the run ended, and returns that ending (`RunResult`) instead of printing it.

    result = run_training({"model": {"name": "tiny"}, "steps": 20, "run_dir": "runs/nb"})
    again = run_training({"steps": 40, "run_dir": str(result.run_dir)}, resume=True)  # continues it

On its way it speaks through `warn` and `note` (stderr by default, process 0 only) and the console
progress; the messages that say how it ended (a stop by a signal, where it saved, the profile) are the
caller's to print, from the result. Errors the user can mend are ShardError; a process lost from a
multi-process job ends this process with exit code 3 (shard.cluster.runtime.fail), as on the command line.
"""

import dataclasses
import os
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path

from shard import config as config_mod
from shard.cluster import launch, runtime
from shard.config.train import TrainConfig
from shard.errors import ShardError, user_error
from shard.measure import profiling
from shard.observe.console import note as console_note
from shard.observe.console import warn as console_warn
from shard.observe.metrics import CompletionsWriter, JsonlWriter, TensorBoardWriter
from shard.observe.progress import ConsoleProgress, compiling_line
from shard.paths import CHECKPOINTS_DIR
from shard.run.checkpoint import Checkpoints, SaveCheckpoints, step_dirs
from shard.run.resume import restore_source
from shard.run.run_dir import compile_cache_dir, continue_command
from shard.run.snapshots import SaveSnapshots, open_snapshots
from shard.run.devices import Notice, check_devices_per_process, start_devices
from shard.run.start import RunDirClaim, StartConfig, resolve_start, run_dir_for, run_dir_named
from shard.sharding.mesh import parse_mesh
from shard.training.observer import Observer
from shard.training.preemption import StopOnSignal, remember_interrupts

FINISHED, STOPPED, NOTHING_TO_DO = "finished", "stopped", "nothing to do"


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How one start of a run ended. `ended` is FINISHED (at --steps), STOPPED (a signal, on this process
    or another: `stopped_by` names it where it arrived here) or NOTHING_TO_DO (its checkpoint was at
    --steps already). `checkpoint` is the newest one this start saved, `records` the steps it logged."""

    run_dir: Path
    config: TrainConfig  # as the run trained with it (and saved it in run_dir/config.toml)
    ended: str
    start_step: int  # where this start began: 0, or the step it resumed from
    last_step: int  # the last step trained (start_step when nothing was to do)
    checkpoint: Path | None
    records: list[dict]
    stopped_by: str | None = None
    profile_summary: dict | None = None  # --profile-steps' summary (profiling.format_summary prints it)
    continue_command: str = ""  # the command that resumes the run, under the launcher that started it
    main: bool = True  # this process speaks for the run (process 0)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run at once (before the loop took the signals, or a second time): `message`
    names the newest complete checkpoint ("" on the processes that do not speak)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def run_training(settings: Mapping | None = None, *, config_file: str | Path | None = None,
                 sets: Sequence[str] = (), resume: bool = False, allow_fresh: bool = False,
                 profile_steps: str | None = None, coordinator: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None, observers: Sequence[Observer] = (),
                 warn: Notice = console_warn, note: Notice = console_note) -> RunResult:
    """Train as `shard train` does: the config layered as defaults < a resumed run's saved config (or the
    model of the init_from weights) < `config_file` < `settings` (nested keys, as the flags give them:
    {"data": {"batch": 16}}) < `sets` ("optimizer.lr=3e-4"); the cluster from the launcher's environment
    or `coordinator`/`num_processes`/`process_id`; `resume` continues the run in run_dir from its newest
    checkpoint (`allow_fresh`: or from step 0 when it has none). `observers` join the run's own (console,
    metrics.jsonl, TensorBoard, the checkpoint saver, the signal stopper). `profile_steps` "A:B"
    profiles those steps into RUN_DIR/profile."""
    restore_signal = remember_interrupts()  # a Ctrl-C that Python drops still stops the run
    try:
        settings = dict(settings or {})
        # The cluster comes from the launcher and the settings alone; from here on, an error on this process
        # reaches the others (runtime.leave_on_error), even before it joins them.
        cluster = launch.spec(os.environ, coordinator, num_processes, process_id)
        defaults, given = config_mod.ClusterConfig(), settings.get("cluster") or {}
        runtime.expect(cluster, given.get("cross_host") or defaults.cross_host,
                       given.get("failure_timeout") or defaults.failure_timeout, defaults.join_timeout,
                       given.get("bind") or defaults.bind)
        if allow_fresh and not resume:
            raise ShardError("--allow-fresh goes with --resume (a start that may find no checkpoint yet); "
                             "without --resume every start is fresh")
        from_file = config_mod.load_file(str(config_file)) if config_file else {}
        run_dir = run_dir_named(settings.get("run_dir"), from_file, resume)
        if run_dir is not None:  # named by the config file for a resume: checked as if given as a setting
            settings["run_dir"] = run_dir
        main = cluster is None or cluster.process_id == 0
        start = resolve_start(lambda base: config_mod.layer(base, from_file, settings, sets), from_file,
                              list(sets), run_dir=run_dir, init_from=settings.get("init_from"), resume=resume,
                              allow_fresh=allow_fresh, cluster=cluster, notice=warn)
        if start.cfg.tracking.project and main:  # before anything compiles
            from shard.observe.tracking import require_wandb

            require_wandb()
        speech = _Speech(main, warn, note)
        return _TrainingRun(start, cluster, resume, allow_fresh, profile_steps, list(observers), speech).train()
    finally:
        restore_signal()


@dataclasses.dataclass(frozen=True)
class _Speech:
    """What a run says on its way: process 0 alone speaks."""

    main: bool
    warn: Notice
    note: Notice

    def notice(self, message: str) -> None:
        """A resume, a cut warmup, a signal: once, by the main process."""
        if runtime.context().is_main:
            self.warn(message)


class _TrainingRun:
    """One start of a run, from the devices to its end. The observers that the ending reads (the
    stopper, the saver, the profiler) are kept here as the loop gets them."""

    def __init__(self, start: StartConfig, cluster, resume: bool, allow_fresh: bool, profile_steps: str | None,
                 observers: list[Observer], speech: _Speech):
        self.start, self.cfg, self.cluster = start, start.cfg, cluster
        self.resume, self.allow_fresh, self.profile_steps = resume, allow_fresh, profile_steps
        self.extra_observers, self.speech = observers, speech
        self.main = speech.main
        self.window = None  # --profile-steps as (first, last), once read
        self.start_step = 0  # where the run resumes, once prepared
        self.cfg_on_record = None  # the config the run trains with, once its run dir is known
        self.checkpoints = self.snapshots = None  # once the run dir is known (snapshots: None when off and none left)
        self.stopper = self.saver = self.profiler = None  # until the loop takes them

    def train(self) -> RunResult:
        path, devices = self._launch()
        claim = RunDirClaim(path, self.main)
        try:  # the claim is held for the whole run, whatever ends it; a new run dir is locked once made
            claim.hold()
            return self._train_in(claim, devices)
        finally:
            if self.main:
                claim.release()

    def _train_in(self, claim: RunDirClaim, devices) -> RunResult:
        self.checkpoints = Checkpoints(claim.path / CHECKPOINTS_DIR, self.cfg.checkpoint, notice=self.speech.notice)
        self.snapshots = open_snapshots(self.cfg.checkpoint, claim.path, self.speech.notice)
        restore = restore_source(self.checkpoints, self.resume, self.allow_fresh, self.cfg.init_from, self.cfg.seed,
                                 self.speech.notice, self.snapshots)
        try:
            run = self._prepare(devices, restore)
            if run is None:  # nothing to do
                runtime.finish()
                return self._result(claim.path, NOTHING_TO_DO, self.start_step, [])
            records = self._loop(run, claim)
        except ShardError:
            raise
        except KeyboardInterrupt:  # Ctrl-C before the loop took the signals, or a second one: out at once
            raise RunInterrupted(self._interrupted()) from None
        except Exception as e:  # a lost peer surfaces as a runtime error in a collective
            if user_error(e) is not None:
                raise  # this process's own error (out of memory, a full disk), not a lost peer's
            runtime.fail(e)  # several processes: names the lost one and exits; one process: re-raises
        runtime.finish()
        return self._ended(run, claim.path, records)

    def _launch(self) -> tuple[Path, list]:
        """The run dir and the devices, once every process agrees on the config, the data and the run dir."""
        from shard.cluster import exchange
        from shard.data.sources import unused_files_note
        from shard.run.agreement import check_same_config, check_same_data, check_shared_run_dir

        cfg = self.cfg
        mesh_spec = parse_mesh(cfg.mesh.spec)
        self.window = profiling.parse_window(self.profile_steps, cfg.steps) if self.profile_steps else None
        if self.main and (note := unused_files_note(self.start.source)):
            self.speech.warn(note)
        path = run_dir_for(cfg, mesh_spec, self.resume, self.main)
        devices = start_devices(cfg, mesh_spec, compile_cache_dir(cfg, path), self.cluster, warn=self.speech.warn,
                                note=self.speech.note)
        path = Path(exchange.broadcast_text(str(path)))
        check_same_config(cfg, {"--resume": self.resume, "--allow-fresh": self.allow_fresh})
        check_devices_per_process(devices)  # after: a different config (a mesh) is the likelier cause
        check_same_data(cfg, self.start.source)
        check_shared_run_dir(path)
        if self.main and self.resume:
            from shard.run.tokenizer import check_run_tokenizer

            check_run_tokenizer(cfg, path, self.start.source)
        return path, devices

    def _prepare(self, devices, restore):
        """The prepared run (restored, compiled), its start said; None when its checkpoint is at --steps."""
        from shard.training.prepare import prepare
        from shard.training.state import warmup_steps

        cfg, window, notice = self.cfg, self.window, self.speech.notice
        reference = None  # a resumed DPO run's reference: the weights it started from
        if cfg.task == "dpo" and cfg.init_from:
            reference = restore_source(None, False, False, cfg.init_from, cfg.seed, notice)
        run = prepare(cfg, devices, restore=restore, reference=reference,
                      compiling=compiling_line if self.main else nullcontext, source=self.start.source)
        self.start_step = run.start_step
        if cfg.init_from and not run.start_step and restore is not None:
            notice(f"initialised from {cfg.init_from}")
        if run.start_step:
            where = getattr(restore, "where", "") or self.checkpoints.path(run.start_step)  # or "local snapshot PATH"
            notice(f"resumed from step {run.start_step} ({where}), data position {run.stream.position}")
        if window and window[0] <= run.start_step:  # a trace opens before the window's first step
            notice(f"--profile-steps {self.profile_steps} starts before step {run.start_step + 1}, where this run "
                   "resumes: nothing is profiled")
        if run.start_step >= cfg.steps:
            return None
        for change in self.start.changes if run.start_step else ():  # a fresh start (--allow-fresh) changes nothing
            notice(change)
        cut = warmup_steps(cfg.optimizer, cfg.steps)
        if cut < cfg.optimizer.warmup_steps and cfg.steps > 1:  # the schedule's cut, said
            notice(f"optimizer.warmup_steps {cfg.optimizer.warmup_steps} is not below --steps {cfg.steps}: the "
                   f"warmup is cut to {cut} step{'s' if cut != 1 else ''}, so the learning rate peaks at the last step")
        return run

    def _loop(self, run, claim: RunDirClaim) -> list[dict]:
        """Write the run's config and train; a first start that fails forgets what it wrote."""
        from shard.training.loop import train as train_loop

        cfg = self.cfg_on_record = self._config_on_record(run, claim.path)
        config_toml = config_mod.to_toml(cfg)
        claim.claim()  # only process 0 prints and writes the run's files
        finished = False
        try:
            claim.write_start(config_toml, cfg.init_from, first_start=not run.start_step)
            observers = self._observers(cfg, claim.path, config_toml)
            records = train_loop(cfg, run=run, observers=observers)
            finished = True
        finally:  # also on divergence: saves already under way commit; nothing newer is written
            self.checkpoints.close()
            if self.snapshots is not None:
                self.snapshots.close()
            if not finished and not run.start_step:  # a first start (--resume --allow-fresh too)
                claim.forget_unstarted()
        return records

    def _config_on_record(self, run, path: Path) -> TrainConfig:
        """The config the run writes and trains with: in its run dir, and the weights it started from."""
        cfg, start = self.cfg, self.start
        if run.start_step and start.resumed and cfg.init_from != start.base.get("init_from", ""):
            # the run's own checkpoint was read: the weights it started from stay the ones on record
            if start.weights:
                self.speech.notice(f"init_from {start.weights} is not read: the run resumes from its own checkpoint")
            cfg = dataclasses.replace(cfg, init_from=start.base.get("init_from", ""))
        return dataclasses.replace(cfg, run_dir=str(path))

    def _observers(self, cfg: TrainConfig, path: Path, config_toml: str) -> list[Observer]:
        """Process 0's console and metrics sinks, the caller's observers, then the saver and the stopper
        (every process saves its shards; the MPI bridge: process 0). Observers end last started first, so
        the saver waits for the final save while the stopper's handlers still take the signals."""
        observers = []
        if self.main:
            from shard.run.tokenizer import save_run_tokenizer

            save_run_tokenizer(cfg, path, self.start.source)
            observers = [ConsoleProgress(cfg, path), JsonlWriter(path / "metrics.jsonl"),
                         TensorBoardWriter(path / "tb")]
            if cfg.task == "grpo":
                observers.append(CompletionsWriter(path / "completions.jsonl"))
            if cfg.tracking.project:
                from shard.observe.tracking import WandbTracker

                observers.append(WandbTracker(cfg, path))
        self.saver = SaveCheckpoints(self.checkpoints, seed=cfg.seed, config_toml=config_toml)
        self.stopper = StopOnSignal(self.speech.notice)
        # local snapshots (checkpoint.local_every) between the saver's checkpoints; before it, so it ends after it
        snapshots = [SaveSnapshots(self.snapshots, self.saver, seed=cfg.seed, config_toml=config_toml)
                     ] if self.snapshots is not None else []
        observers += [*self.extra_observers, self.stopper, *snapshots, self.saver]
        if self.window and self.main:
            self.profiler = profiling.Profiler(*self.window, path / "profile")
            observers.append(self.profiler)
        return observers

    def _interrupted(self) -> str:
        """What a Ctrl-C that stops at once leaves: the newest complete checkpoint, said by process 0."""
        if not self.main:
            return ""
        done = step_dirs(self.checkpoints.directory)  # on disk: a save under way may have finished
        newest = self.checkpoints.path(done[-1]) if done else "none"
        if self.stopper is not None and self.stopper.received:
            return (f"interrupted again: stopped at once, without waiting for the save; the newest complete "
                    f"checkpoint is {newest} (an unfinished one is removed by --resume)")
        return f"interrupted: stopped at once; the newest complete checkpoint is {newest}"

    def _ended(self, run, path: Path, records: list[dict]) -> RunResult:
        """A run that trained: finished at --steps, or stopped by a signal after saving."""
        ended = FINISHED if run.stopped_at is None else STOPPED
        return self._result(path, ended, run.stopped_at if ended == STOPPED else self.cfg.steps, records)

    def _result(self, path: Path, ended: str, last_step: int, records: list[dict]) -> RunResult:
        saved = self.saver.last_saved if self.saver is not None else None
        summary = self.profiler.summary if self.profiler is not None else None
        config = self.cfg_on_record or dataclasses.replace(self.cfg, run_dir=str(path))
        return RunResult(run_dir=path, config=config, ended=ended, start_step=self.start_step, last_step=last_step,
                         checkpoint=self.checkpoints.path(saved) if saved else None, records=records,
                         stopped_by=self.stopper.received if self.stopper is not None else None,
                         profile_summary=summary or None, continue_command=continue_command(path, self.cluster),
                         main=self.main)
