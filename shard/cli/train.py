"""`shard train`: resolve the config (shard.run.start), start the devices, claim the run dir, run the
loop with its observers, and say how the run ended."""

import dataclasses
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer

from shard.cli.options import (ConfigOpt, MeshOpt, ModelOpt, SetOpt, SimOpt, config_file, overrides, start_devices,
                               warn)
from shard import config as config_mod
from shard.errors import ShardError
from shard.measure import profiling
from shard.observe.console import console, err_console
from shard.observe.progress import ConsoleProgress, compiling_line
from shard.paths import CHECKPOINTS_DIR
from shard.run.resume import restore_source
from shard.run.run_dir import compile_cache_dir, continue_command
from shard.run.start import (RunDirClaim, StartConfig, check_devices_per_process, resolve_start, run_dir_for,
                             run_dir_named)
from shard.sharding.mesh import parse_mesh


def train(
    mesh: MeshOpt = None,
    model: ModelOpt = None,
    steps: Annotated[int | None, typer.Option(help="optimizer steps")] = None,
    batch: Annotated[int | None, typer.Option(help="global batch, in sequences")] = None,
    seq: Annotated[int | None, typer.Option(help="sequence length")] = None,
    data: Annotated[str | None, typer.Option(
        help="a token store (shard data prepare), a mixture .toml, text/JSONL/Parquet files, a folder or glob of "
             "them, a saved dataset, .npy/.bin tokens, or 'synthetic'")] = None,
    tokenizer: Annotated[str | None, typer.Option(
        help="byte, a tokenizer.json or a folder with one, or a SentencePiece .model (default: the store's, else byte)")] = None,
    packing: Annotated[str | None, typer.Option(
        help="concat: windows across documents | packed: whole documents per row, attention within each")] = None,
    seed: Annotated[int | None, typer.Option(help="seed for init and data order")] = None,
    run_dir: Annotated[str | None, typer.Option("--run-dir", help="where config, metrics and checkpoints go")] = None,
    log_every: Annotated[int | None, typer.Option("--log-every", help="log every N steps")] = None,
    profile_steps: Annotated[str | None, typer.Option(
        "--profile-steps", help="profile steps A to B (given as A:B) into RUN_DIR/profile and summarise them")] = None,
    compile_cache: Annotated[str | None, typer.Option(
        "--compile-cache", help="persistent compilation cache dir (default: beside the run dir; 'none': off)")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(
        "--checkpoint-every", help="save a checkpoint every N steps (default 1000; 0: off; the last step and preemption always save)")] = None,
    keep: Annotated[int | None, typer.Option("--keep", help="keep the newest K checkpoints")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="continue the run in --run-dir from its newest complete checkpoint")] = False,
    allow_fresh: Annotated[bool, typer.Option(
        "--allow-fresh", help="with --resume: start from step 0 when there is no checkpoint yet")] = False,
    init_from: Annotated[str | None, typer.Option(
        "--init-from", help="start from these weights (a shard checkpoint or a Hugging Face folder)")] = None,
    task: Annotated[str | None, typer.Option(
        "--task", help="pretrain (default) | sft: chat rows, loss on assistant turns | dpo: preference pairs")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    simulate_devices: SimOpt = None,
    coordinator: Annotated[str | None, typer.Option(help="HOST:PORT of process 0, to start processes by hand (with --num-processes, --process-id)")] = None,
    num_processes: Annotated[int | None, typer.Option("--num-processes", help="processes in the job (explicit form)")] = None,
    process_id: Annotated[int | None, typer.Option("--process-id", help="this process's id, 0..N-1 (explicit form)")] = None,
    cross_host: Annotated[str | None, typer.Option("--cross-host", help="xla: one global mesh (default) | mpi: local meshes + MPI all-reduce")] = None,
    failure_timeout: Annotated[float | None, typer.Option("--failure-timeout", help="seconds before a silent process counts as lost (default 60)")] = None,
    bind: Annotated[str | None, typer.Option("--bind", help="where the coordinator and gloo listen: auto (loopback when every process is on this host) | loopback | all | an interface (eth1)")] = None,
    eval_every: Annotated[int | None, typer.Option("--eval-every", help="held-out loss every N steps, on the eval.processes first processes")] = None,
    wandb: Annotated[str | None, typer.Option(
        "--wandb", help="log to this Weights & Biases project (needs shard[wandb]; [tracking] sets the rest)")] = None,
):
    """Train a model on a device mesh; under mpiexec or srun, on every process of the job."""
    from shard.cli.app import at_command_end  # not at the top: app imports this module
    from shard.cluster import runtime
    from shard.cluster import launch as cluster_mod
    from shard.training.preemption import remember_interrupts

    # The cluster comes from flags and the launcher alone; from here on, an error on this process
    # reaches the others (runtime.leave_on_error), even before it joins them.
    at_command_end.append(remember_interrupts())  # a Ctrl-C that Python drops still stops the run
    cluster = cluster_mod.spec(os.environ, coordinator, num_processes, process_id)
    defaults = config_mod.ClusterConfig()  # until the config is read
    runtime.expect(cluster, cross_host or defaults.cross_host, failure_timeout or defaults.failure_timeout,
                   defaults.join_timeout, bind or defaults.bind)
    if allow_fresh and not resume:
        raise ShardError("--allow-fresh goes with --resume (a start that may find no checkpoint yet); without "
                         "--resume every start is fresh")
    from_file = config_file(config)
    run_dir = run_dir_named(run_dir, from_file, resume)
    flags = dict(mesh=mesh, model=model, steps=steps, batch=batch, seq=seq, data=data, seed=seed, run_dir=run_dir,
                 simulate_devices=simulate_devices, log_every=log_every, compile_cache=compile_cache,
                 checkpoint_every=checkpoint_every, keep=keep, cross_host=cross_host,
                 failure_timeout=failure_timeout, bind=bind, eval_every=eval_every, init_from=init_from,
                 tokenizer=tokenizer, packing=packing, wandb=wandb, task=task)
    start = resolve_start(lambda base: overrides(from_file, set_, base, **flags), from_file, set_, run_dir=run_dir,
                          init_from=init_from, resume=resume, allow_fresh=allow_fresh, cluster=cluster, notice=warn)
    if start.cfg.tracking.project and (cluster is None or cluster.process_id == 0):  # before anything compiles
        from shard.observe.tracking import require_wandb

        require_wandb()
    _Run(start, cluster, resume, allow_fresh, profile_steps).train()


def _notice(message: str) -> None:
    """What the run says on its way (a resume, a cut warmup, a signal): once, by the main process."""
    from shard.cluster import runtime

    if runtime.context().is_main:
        warn(message)


class _Run:
    """One start of a run, from the devices to its last message. The observers that the error and end
    messages read (the stopper, the saver, the profiler) are kept here as the loop gets them."""

    def __init__(self, start: StartConfig, cluster, resume: bool, allow_fresh: bool, profile_steps: str | None):
        self.start, self.cfg, self.cluster = start, start.cfg, cluster
        self.resume, self.allow_fresh, self.profile_steps = resume, allow_fresh, profile_steps
        self.main = cluster is None or cluster.process_id == 0
        self.window = None  # --profile-steps as (first, last), once read
        self.checkpoints = None  # once the run dir is known
        self.stopper = self.saver = self.profiler = None  # until the loop takes them

    def train(self) -> None:
        from shard.cli.app import at_command_end, user_error
        from shard.cluster import runtime
        from shard.run.checkpoint import Checkpoints

        path, devices = self._launch()
        claim = RunDirClaim(path, self.main)
        if self.main:  # for the whole run, whatever ends it; a new run dir is locked once it is made (claim)
            at_command_end.append(claim.release)
        claim.hold()
        self.checkpoints = Checkpoints(path / CHECKPOINTS_DIR, self.cfg.checkpoint, notice=_notice)
        restore = restore_source(self.checkpoints, self.resume, self.allow_fresh, self.cfg.init_from, self.cfg.seed,
                                 _notice)
        try:
            run = self._prepare(devices, restore)
            if run is None:  # nothing to do
                runtime.finish()
                return
            self._loop(run, claim)
        except ShardError:
            raise
        except KeyboardInterrupt:  # Ctrl-C before the loop took the signals, or a second one: out at once
            self._interrupted()
            raise SystemExit(130) from None
        except Exception as e:  # a lost peer surfaces as a runtime error in a collective
            if user_error(e) is not None:
                raise  # this process's own error (out of memory, a full disk), not a lost peer's
            runtime.fail(e)  # several processes: names the lost one and exits; one process: re-raises
        self._ended(run, path)
        runtime.finish()

    def _launch(self) -> tuple[Path, list]:
        """The run dir and the devices, once every process agrees on the config, the data and the run dir."""
        from shard.cluster import exchange
        from shard.data.sources import data_source, unused_files_note
        from shard.run.agreement import check_same_config, check_same_data, check_shared_run_dir

        cfg = self.cfg
        mesh_spec = parse_mesh(cfg.mesh.spec)
        self.window = profiling.parse_window(self.profile_steps, cfg.steps) if self.profile_steps else None
        if self.main and (note := unused_files_note(data_source(cfg))):
            warn(note)
        path = run_dir_for(cfg, mesh_spec, self.resume, self.main)
        devices = start_devices(cfg, mesh_spec, compile_cache_dir(cfg, path), self.cluster)
        path = Path(exchange.broadcast_text(str(path)))
        check_same_config(cfg, {"--resume": self.resume, "--allow-fresh": self.allow_fresh})
        check_devices_per_process(devices)  # after: a different config (a mesh) is the likelier cause
        check_same_data(cfg)
        check_shared_run_dir(path)
        if self.main and self.resume:
            from shard.run.tokenizer import check_run_tokenizer

            check_run_tokenizer(cfg, path)
        return path, devices

    def _prepare(self, devices, restore):
        """The prepared run (restored, compiled), its start said; None when its checkpoint is at --steps."""
        from shard.training.prepare import prepare
        from shard.training.state import warmup_steps

        cfg, window = self.cfg, self.window
        reference = None  # a resumed DPO run's reference: the weights it started from
        if cfg.task == "dpo" and cfg.init_from:
            reference = restore_source(None, False, False, cfg.init_from, cfg.seed, _notice)
        run = prepare(cfg, devices, restore=restore, reference=reference,
                      compiling=compiling_line if self.main else nullcontext)
        if cfg.init_from and not run.start_step and restore is not None:
            _notice(f"initialised from {cfg.init_from}")
        if run.start_step:
            _notice(f"resumed from step {run.start_step} ({self.checkpoints.path(run.start_step)}), "
                    f"data position {run.stream.position}")
        if window and window[0] <= run.start_step:  # a trace opens before the window's first step
            _notice(f"--profile-steps {self.profile_steps} starts before step {run.start_step + 1}, where this run "
                    "resumes: nothing is profiled")
        if run.start_step >= cfg.steps:
            if self.main:
                console.print(f"nothing to do: the checkpoint is at step {run.start_step} and --steps is "
                              f"{cfg.steps}")
            return None
        for change in self.start.changes if run.start_step else ():  # a fresh start (--allow-fresh) changes nothing
            _notice(change)
        cut = warmup_steps(cfg.optimizer, cfg.steps)
        if cut < cfg.optimizer.warmup_steps and cfg.steps > 1:  # the schedule's cut, said
            _notice(f"optimizer.warmup_steps {cfg.optimizer.warmup_steps} is not below --steps {cfg.steps}: the "
                    f"warmup is cut to {cut} step{'s' if cut != 1 else ''}, so the learning rate peaks at the last step")
        return run

    def _loop(self, run, claim: RunDirClaim) -> None:
        """Write the run's config and train; a first start that fails forgets what it wrote."""
        from shard.training.preemption import StopOnSignal
        from shard.observe.metrics import JsonlWriter, TensorBoardWriter
        from shard.run.checkpoint import SaveCheckpoints
        from shard.training.loop import train as train_loop

        cfg, start, path = self.cfg, self.start, claim.path
        if run.start_step and start.resumed and cfg.init_from != start.base.get("init_from", ""):
            # the run's own checkpoint was read: the weights it started from stay the ones on record
            if start.weights:
                _notice(f"init_from {start.weights} is not read: the run resumes from its own checkpoint")
            cfg = dataclasses.replace(cfg, init_from=start.base.get("init_from", ""))
        cfg = dataclasses.replace(cfg, run_dir=str(path))
        config_toml = config_mod.to_toml(cfg)
        observers = []
        claim.claim()  # only process 0 prints and writes the run's files
        finished = False
        try:
            claim.write_start(config_toml, cfg.init_from, first_start=not run.start_step)
            if self.main:
                from shard.run.tokenizer import save_run_tokenizer

                save_run_tokenizer(cfg, path)
            if self.main:
                observers = [ConsoleProgress(cfg, path), JsonlWriter(path / "metrics.jsonl"),
                             TensorBoardWriter(path / "tb")]
                if cfg.tracking.project:
                    from shard.observe.tracking import WandbTracker

                    observers.append(WandbTracker(cfg, path))
            self.saver = SaveCheckpoints(self.checkpoints, seed=cfg.seed, config_toml=config_toml)
            self.stopper = StopOnSignal(_notice)
            # every process saves its shards (the MPI bridge: process 0); observers end last started first,
            # so the saver waits for the final save while the stopper's handlers still take the signals
            observers += [self.stopper, self.saver]
            if self.window and self.main:
                self.profiler = profiling.Profiler(*self.window, path / "profile")
                observers.append(self.profiler)
            train_loop(cfg, run=run, observers=observers)
            finished = True
        finally:  # also on divergence: saves already under way commit; nothing newer is written
            self.checkpoints.close()
            if not finished and not run.start_step:  # a first start (--resume --allow-fresh too)
                claim.forget_unstarted()

    def _interrupted(self) -> None:
        """What a Ctrl-C that stops at once leaves: the newest complete checkpoint."""
        from shard.run.checkpoint import step_dirs

        if not self.main:
            return
        done = step_dirs(self.checkpoints.directory)  # on disk: a save under way may have finished
        newest = self.checkpoints.path(done[-1]) if done else "none"
        if self.stopper is not None and self.stopper.received:
            err_console.print(f"interrupted again: stopped at once, without waiting for the save; the newest "
                              f"complete checkpoint is {newest} (an unfinished one is removed by --resume)",
                              soft_wrap=True)
        else:
            err_console.print(f"interrupted: stopped at once; the newest complete checkpoint is {newest}",
                              soft_wrap=True)

    def _ended(self, run, path: Path) -> None:
        """The profile's summary, and where a run stopped by a signal saved and how to continue it."""
        if not self.main:
            return
        if self.profiler is not None and self.profiler.summary:
            console.print(profiling.format_summary(self.profiler.summary), soft_wrap=True)
        if run.stopped_at is not None:
            saver, stopper = self.saver, self.stopper
            where = self.checkpoints.path(saver.last_saved) if saver.last_saved else "(no checkpoint)"
            console.print(f"stopped by {stopper.received or 'a signal on another process'} after step "
                          f"{run.stopped_at}; checkpoint saved to {where}; "
                          f"continue with: {continue_command(path, self.cluster)}", soft_wrap=True)
