"""The `shard` command. JAX is imported only after the simulated device count is settled."""

import collections
import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Annotated

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shard.config import train as config_mod
from shard.measure import profiling
from shard.startup.compile_cache import use_compile_cache
from shard.errors import ShardError, first_line, out_of_memory
from shard.sharding.mesh import MeshSpec, devices_needed, parse_mesh, rename_mesh_file, split_mesh_file
from shard.observe.console import console, err_console, human_bytes, param_count, short_bytes
from shard.paths import (CHECKPOINTS_DIR, RunDirLock, check_fresh_out, check_outside_checkpoints, globless,
                         write_text_atomic, written_whole)
from shard.observe.progress import ConsoleProgress
from shard.run.resume import (check_hf_model_is_preset, init_from_base, restore_source, resume_base,
                                 resume_changes)
from shard.run.run_dir import (choose_run_dir, compile_cache_dir, continue_command, forget_unstarted_run,
                                  holds_run, start_files)

# What to change when a command runs out of device memory.
_OUT_OF_MEMORY_ADVICE = {"train": "to train, lower --batch or --seq, or set model.remat=full",
                         "generate": "give fewer or shorter prompts, or lower --max-new-tokens",
                         "inspect": "lower --batch or --seq", "eval": "lower --batch or --seq"}


def user_error(e: BaseException, command: str | None = "train") -> ShardError | None:
    """The one-line error for an exception the user's input or machine causes rather than a bug in
    shard: a ShardError, a file system error (a file where a folder belongs, no permission, disk full,
    also when tensorstore reports it), or running out of device memory. None for anything else, which
    keeps its traceback."""
    if isinstance(e, ShardError):
        return e
    if isinstance(e, OSError) and not isinstance(e, BrokenPipeError | ConnectionError | TimeoutError):
        where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f)
        return ShardError(f"{where}: {e.strerror or e}" if where else f"{type(e).__name__}: {e}")
    first = first_line(e)
    if "os_error_code=" in str(e):  # tensorstore's file errors (checkpoints)
        return ShardError(_tensorstore_file_error(str(e)))
    if out_of_memory(e):
        advice = _OUT_OF_MEMORY_ADVICE.get(command or "")
        return ShardError(f"out of memory ({first[:160]})" + (f"; {advice}" if advice else ""))
    if isinstance(e, RuntimeError) and "Unable to initialize backend" in first:
        return ShardError(f"{first} (JAX_PLATFORMS is {os.environ.get('JAX_PLATFORMS', 'unset')!r})")
    return None


def _tensorstore_file_error(text: str) -> str:
    """`PATH: REASON` from tensorstore's file error: the OS's reason is the last `: ` part once the
    bracketed annotations (`[os_error_code='28']`, `[source locations='...']`, `[tensorstore_spec='{...}']`,
    kilobytes of JSON) are dropped; the path is the first local file it names."""
    bare = re.sub(r" \[[\w ]+=(?:'[^']*'|[^\]\s]*)\]", "", text.strip()).splitlines()[0]
    reason = bare.rsplit(": ", 1)[-1].strip()
    paths = re.findall(r'"(/[^"]*)"', bare)
    return f"{paths[0]}: {reason}" if paths else f"{reason} ({bare[:200]})"


def _usage_error(e: BaseException) -> ShardError | None:
    """A flag a command can't take (unknown, malformed, missing its value) as one line, like every other
    user error, instead of the usage box. Known by class name: typer bundles its own click, older typer
    uses click's, and both name it UsageError (NoArgsIsHelpError, one of them, is the help: left alone)."""
    if not any(c.__name__ == "UsageError" for c in type(e).__mro__) or type(e).__name__ == "NoArgsIsHelpError":
        return None
    ctx = getattr(e, "ctx", None)
    return ShardError(f"{e.format_message()}" + (f" (see {ctx.command_path} --help)" if ctx else ""))


class CommandGroup(typer.core.TyperGroup):
    """Every command's user errors end the same way: one line on stderr, exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Exception as e:
            distributed = sys.modules.get("shard.cluster.distributed")
            if distributed:
                distributed.wait_if_stopping()  # another thread is reporting the cause and exits
            error = user_error(e, ctx.invoked_subcommand) or _usage_error(e)
            if error is None:
                raise
            _fail(error)
        finally:  # a cluster one command expected to join is not the next one's (in-process calls)
            if distributed := sys.modules.get("shard.cluster.distributed"):
                distributed.expect(None)
            while _at_command_end:
                _at_command_end.pop()()


_at_command_end: list = []  # what a command holds until it ends, however it ends (a run dir's lock)


app = typer.Typer(cls=CommandGroup, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train Transformers on any device mesh: the parallel layout is data, not code.")

DEFAULT_FILL_DEVICES = 8
MAX_SIMULATED_DEVICES = 4096  # 13 s for XLA's CPU platform to start; 100,000 would take hours

# Options shared by the commands that build a mesh and a model.
MeshOpt = Annotated[str | None, typer.Option("--mesh", help="8x4 | data=2,fsdp=2,model=2 | preset (shard/meshes/) | preset:4x2")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="model preset: tiny, small, moe-tiny, llama-1b, llama-7b, ...")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML config file")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override a config key: --set optimizer.lr=3e-4")]
PlanSetOpt = Annotated[list[str] | None, typer.Option("--set", help="override a model key: --set model.remat=full")]
SimOpt = Annotated[int | None, typer.Option("--simulate-devices", help="CPU devices to simulate in each process (default: what the mesh needs, 8 to fill)")]
CheckpointArg = Annotated[str | None, typer.Argument(help="run dir, its checkpoints/ dir, or one step's dir", show_default=False)]
CheckpointOpt = Annotated[str | None, typer.Option("--checkpoint", help="the same, as an option", show_default=False)]


def _checkpoint_given(positional: str | None, option: str | None) -> str:
    """The checkpoint a reading command was given, as its first argument or as --checkpoint (both work)."""
    if positional is None and option is None:
        raise ShardError("give a checkpoint: a run dir, its checkpoints/ dir or one step's dir, as the first "
                         "argument or as --checkpoint")
    if positional is not None and option is not None:
        raise ShardError("give the checkpoint once: as the first argument or as --checkpoint")
    return positional if positional is not None else option


def _config_file(config: Path | None) -> dict:
    """The --config file's table ({} without one), read once per command."""
    return config_mod.load_file(str(config)) if config else {}


def _overrides(from_file: dict, sets: list[str] | None, base: dict | None = None, **flags) -> dict:
    """defaults < base (a resumed run's config) < config file < flags < --set, as one nested dict."""
    flag_keys = {"mesh": "mesh.spec", "model": "model.name", "steps": "steps", "batch": "data.batch",
                 "seq": "data.seq_len", "data": "data.path", "seed": "seed", "run_dir": "run_dir",
                 "simulate_devices": "mesh.simulate_devices", "log_every": "log_every",
                 "compile_cache": "xla.compile_cache",
                 "checkpoint_every": "checkpoint.every", "keep": "checkpoint.keep",
                 "cross_host": "cluster.cross_host", "failure_timeout": "cluster.failure_timeout",
                 "eval_every": "eval.every", "init_from": "init_from"}
    if flags.get("run_dir") is not None and not flags["run_dir"].strip():
        raise ShardError("empty --run-dir: name a folder, or leave the flag out for runs/<model>-<mesh>-<time>")
    if flags.get("simulate_devices") is not None and flags["simulate_devices"] <= 0:
        raise ShardError(f"--simulate-devices must be positive, got {flags['simulate_devices']}")
    out = config_mod.merge(base or {}, from_file)
    flat = {flag_keys[k]: v for k, v in flags.items() if v is not None}
    out = config_mod.merge(out, config_mod.nested(flat))
    out = config_mod.merge(out, config_mod.parse_sets(sets or []))
    if isinstance(model := out.get("model"), dict):  # not: resolve says what else it is
        _check_model_named_over_file(from_file.get("model"), model.get("name"))
    return out


def _check_model_named_over_file(file_model, name) -> None:
    """A config file whose [model] describes one model whole (a run's config.toml lists every key)
    would amend the preset --model names into that model under the other name. A partial [model] (a
    recipe's remat or dtype) amends whichever model is named, as documented."""
    if not isinstance(file_model, dict) or file_model.get("name", name) == name:
        return
    if set(file_model) >= set(config_mod.field_names()):
        raise ShardError(f"--model {name}: the config file describes model {file_model['name']} whole (every "
                         f"[model] key, as a run's config.toml does), which would give {name} its dimensions; leave "
                         "out --model, or the file's [model] section")


def start_devices(cfg: config_mod.TrainConfig, mesh_spec: MeshSpec, compile_cache: Path | None = None,
                  cluster=None):
    """Settle XLA flags and the CPU device count (per process), join the cluster if there is one, start
    JAX, and return the devices the mesh will use (every process's with --cross-host xla, this one's
    with mpi)."""
    from shard.cluster import distributed
    from shard.startup import xla_flags
    from shard.startup.devices import jax_started, request_host_devices

    unknown = []
    if not jax_started():
        unknown = xla_flags.apply(gpu_preset=cfg.xla.gpu_flags, deterministic=cfg.xla.deterministic)
    n_proc = cluster.num_processes if cluster else 1
    needed = devices_needed(mesh_spec, DEFAULT_FILL_DEVICES * n_proc)
    if not cfg.mesh.simulate_devices and needed % n_proc:
        raise ShardError(f"mesh {mesh_spec.describe()} needs {needed} devices, which do not split evenly "
                         f"over {n_proc} processes")
    wanted = cfg.mesh.simulate_devices or needed // n_proc
    if wanted > MAX_SIMULATED_DEVICES:
        what = f"--simulate-devices {wanted} asks for" if cfg.mesh.simulate_devices else \
            f"mesh {mesh_spec.describe()} needs {wanted} devices in one process,"
        raise ShardError(f"{what} more than the "
                         f"{MAX_SIMULATED_DEVICES} CPU devices shard simulates (XLA's start-up time grows "
                         "with the square); use `shard plan` for bigger clusters")
    asked = request_host_devices(wanted)
    ctx = distributed.start(cluster, cfg.cluster.cross_host, cfg.cluster.failure_timeout, cfg.cluster.join_timeout)
    import jax

    from shard.startup.imports import import_flax

    import_flax()  # before the model code imports it

    if compile_cache is not None:
        use_compile_cache(compile_cache)
    devices = jax.devices() if ctx.mode != distributed.MPI else jax.local_devices()
    if unknown and ctx.is_main:  # said once, not by every process
        err_console.print(f"[yellow]warning: this XLA does not know {', '.join(unknown)} (renamed or retired in "
                          "this jaxlib): left out of shard's XLA flags[/yellow]", soft_wrap=True)
    if asked and devices[0].platform == "cpu" and wanted > 1 and ctx.is_main and not cfg.mesh.simulate_devices:
        each = f" in each of {n_proc} processes" if n_proc > 1 else ""
        err_console.print(f"[dim]simulating {wanted} CPU devices{each} (XLA host platform); "
                          "set --simulate-devices to change[/dim]", soft_wrap=True)
    return devices


def _check_devices_per_process(devices) -> None:
    """Every process of one global mesh holds as many devices (each process sees them all, so each
    says the same): unequal, the mesh can't be laid out (a reshape error deep in orbax, before)."""
    counts = collections.Counter(d.process_index for d in devices)
    if len(set(counts.values())) > 1:
        held = ", ".join(f"process {p}: {n}" for p, n in sorted(counts.items()))
        raise ShardError(f"the processes hold different numbers of devices ({held}); start every process with "
                         "the same --num-processes and --simulate-devices, on hosts with as many accelerators")


def _fail(e: Exception):
    from shard.cluster.distributed import leave_on_error

    err_console.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
    leave_on_error(str(e), 2)  # several processes: the others learn of it (or the job stops); exits there
    raise typer.Exit(2)


def _warn(message: str) -> None:
    err_console.print(f"[yellow]{escape(message)}[/yellow]", soft_wrap=True)


def _init_from_given(flag: str | None, from_file: dict, sets: list[str] | None) -> str:
    """The weights a start is told to begin from, as the config will hold them: --set over --init-from
    over the --config file."""
    from_sets = config_mod.parse_sets(sets or []).get("init_from")
    if isinstance(from_sets, dict):
        raise ShardError(f"config key 'init_from' is a value, not a section, so 'init_from.{next(iter(from_sets))}' "
                         "is not a key")
    if from_sets is not None:
        return str(from_sets)
    if flag is not None:
        return flag
    return str(from_file.get("init_from", ""))


def _absolute_paths(cfg: config_mod.TrainConfig) -> config_mod.TrainConfig:
    """The config with data.path and eval.path (once checked to exist), a mesh file and init_from made
    absolute: the saved config then names the same files wherever a resume starts from (a relative one
    read another folder's, or none). init_from is read only when the run has no checkpoint yet, so it is
    not checked here."""
    from shard.data.sources import EMBEDDED, SYNTHETIC

    def absolute(path: str, key: str) -> str:
        if path in ("", EMBEDDED, SYNTHETIC):
            return path
        if not Path(path).exists():
            raise ShardError(f"{key} {path} does not exist")
        return str(Path(path).absolute())

    data = dataclasses.replace(cfg.data, path=absolute(cfg.data.path, "data path"))
    # unused without eval.every, so not required to exist; but a later --eval-every must find the same files
    unused_and_missing = not cfg.eval.every and not Path(cfg.eval.path or ".").exists()
    evaluation = cfg.eval if unused_and_missing else dataclasses.replace(cfg.eval,
                                                                         path=absolute(cfg.eval.path, "eval.path"))
    init_from = str(Path(cfg.init_from).absolute()) if cfg.init_from else ""
    mesh_file, _ = split_mesh_file(cfg.mesh.spec) or ("", "")
    if mesh_file and Path(mesh_file).is_file():
        spec = rename_mesh_file(cfg.mesh.spec, lambda path: str(path.absolute()))
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, spec=spec))
    return dataclasses.replace(cfg, data=data, eval=evaluation, init_from=init_from)


@app.command()
def train(
    mesh: MeshOpt = None,
    model: ModelOpt = None,
    steps: Annotated[int | None, typer.Option(help="optimizer steps")] = None,
    batch: Annotated[int | None, typer.Option(help="global batch, in sequences")] = None,
    seq: Annotated[int | None, typer.Option(help="sequence length")] = None,
    data: Annotated[str | None, typer.Option(help="text file/folder, .npy/.bin tokens, or 'synthetic'")] = None,
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
    config: ConfigOpt = None,
    set_: SetOpt = None,
    simulate_devices: SimOpt = None,
    coordinator: Annotated[str | None, typer.Option(help="HOST:PORT of process 0, to start processes by hand (with --num-processes, --process-id)")] = None,
    num_processes: Annotated[int | None, typer.Option("--num-processes", help="processes in the job (explicit form)")] = None,
    process_id: Annotated[int | None, typer.Option("--process-id", help="this process's id, 0..N-1 (explicit form)")] = None,
    cross_host: Annotated[str | None, typer.Option("--cross-host", help="xla: one global mesh (default) | mpi: local meshes + MPI all-reduce")] = None,
    failure_timeout: Annotated[float | None, typer.Option("--failure-timeout", help="seconds before a silent process counts as lost (default 60)")] = None,
    eval_every: Annotated[int | None, typer.Option("--eval-every", help="held-out loss every N steps, on the eval.processes first processes")] = None,
):
    """Train a model on a device mesh; under mpiexec or srun, on every process of the job."""

    from shard.cluster import launch as cluster_mod
    from shard.cluster import distributed

    # The cluster comes from flags and the launcher alone; from here on, an error on this process
    # reaches the others (distributed.leave_on_error), even before it joins them.
    from shard.train.preemption import remember_interrupts

    _at_command_end.append(remember_interrupts())  # a Ctrl-C that Python drops still stops the run
    cluster = cluster_mod.spec(os.environ, coordinator, num_processes, process_id)
    defaults = config_mod.ClusterConfig()  # until the config is read
    distributed.expect(cluster, cross_host or defaults.cross_host, failure_timeout or defaults.failure_timeout,
                       defaults.join_timeout)
    if allow_fresh and not resume:
        raise ShardError("--allow-fresh goes with --resume (a start that may find no checkpoint yet); without "
                         "--resume every start is fresh")
    main = cluster is None or cluster.process_id == 0
    from_file = _config_file(config)
    if resume and run_dir is None:  # the run dir named in the config file given
        run_dir = from_file.get("run_dir") or None
    base = resume_base(run_dir, allow_fresh, notice=_warn if main else None) if resume else None
    resumed = bool(base)  # the run dir holds a run's config
    weights = _init_from_given(init_from, from_file, set_)
    if weights and not resumed:  # a new run, or the first start of a --resume --allow-fresh one
        base = init_from_base(weights)
    cfg = config_mod.resolve(_overrides(
        from_file, set_, base, mesh=mesh, model=model, steps=steps, batch=batch, seq=seq, data=data, seed=seed,
        run_dir=run_dir, simulate_devices=simulate_devices, log_every=log_every, compile_cache=compile_cache,
        checkpoint_every=checkpoint_every, keep=keep, cross_host=cross_host, failure_timeout=failure_timeout,
        eval_every=eval_every, init_from=init_from))
    from shard.run.hf import is_hf_dir

    saved_name = (base or {}).get("model", {}).get("name")
    if saved_name and cfg.model.name != saved_name:
        if weights and not resumed and is_hf_dir(weights):  # a folder's model is named after the folder
            check_hf_model_is_preset(weights, base["model"], cfg.model.name)  # no error: the preset's name it is
        else:
            source = f"--resume continues the {saved_name} run in {run_dir}" if resumed else \
                f"init_from {weights} holds a {saved_name} model"
            raise ShardError(f"{source}; model {cfg.model.name} can't be loaded from it (leave out --model)")
    distributed.expect(cluster, cfg.cluster.cross_host, cfg.cluster.failure_timeout, cfg.cluster.join_timeout)
    if cluster is None and cfg.cluster.cross_host == distributed.MPI:
        err_console.print("[yellow]--cross-host mpi: no launcher started other processes (mpiexec -n N, or srun), "
                          "so this is one process[/yellow]", soft_wrap=True)
    cfg = _absolute_paths(cfg)
    changes = resume_changes(base, cfg) if resumed and main else []  # said once a checkpoint is read
    if weights and not resumed and main:
        from shard.run.hf import context_note

        if note := context_note(cfg.init_from, cfg.data.seq_len):
            err_console.print(f"[yellow]{escape(note)}[/yellow]", soft_wrap=True)
    mesh_spec = parse_mesh(cfg.mesh.spec)
    window = profiling.parse_window(profile_steps, cfg.steps) if profile_steps else None
    from shard.data.sources import unused_files_note

    if main and (note := unused_files_note(cfg.data.path)):
        err_console.print(f"[yellow]{escape(note)}[/yellow]", soft_wrap=True)
    # Process 0 chooses the run dir (a default name has a time stamp) and tells the others once JAX
    # runs; until then they only need its parent, for the compile cache.
    path = choose_run_dir(cfg, mesh_spec, resume) if main else Path(cfg.run_dir or "runs/pending")
    globless(path.absolute() / CHECKPOINTS_DIR)  # before anything is written, the compile cache included
    devices = start_devices(cfg, mesh_spec, compile_cache_dir(cfg, path), cluster)
    path = Path(distributed.broadcast_text(str(path)))
    from shard.run.agreement import check_same_config, check_same_data, check_shared_run_dir

    check_same_config(cfg, {"--resume": resume, "--allow-fresh": allow_fresh})
    _check_devices_per_process(devices)  # after: a different config (a mesh) is the likelier cause
    check_same_data(cfg)
    check_shared_run_dir(path)
    from shard.run.checkpoint import Checkpoints, SaveCheckpoints, step_dirs
    from shard.train.loop import prepare
    from shard.train.loop import train as train_loop
    from shard.observe.metrics import JsonlWriter, TensorBoardWriter
    from shard.train.preemption import StopOnSignal

    def notice(message: str) -> None:
        if distributed.context().is_main:
            err_console.print(f"[yellow]{escape(message)}[/yellow]", soft_wrap=True)

    lock = RunDirLock(path)
    existed = path.is_dir()
    if main:  # for the whole run, whatever ends it; a new run dir is locked once it is made, below
        _at_command_end.append(lock.release)
        if existed:
            lock.acquire()
    checkpoints = Checkpoints(path / CHECKPOINTS_DIR, cfg.checkpoint, notice=notice)
    restore = restore_source(checkpoints, resume, allow_fresh, cfg.init_from, cfg.seed, notice)
    stopper = None  # until the loop takes the signals
    try:
        run = prepare(cfg, devices, restore=restore)
        if cfg.init_from and not run.start_step and restore is not None:
            notice(f"initialised from {cfg.init_from}")
        if run.start_step:
            notice(f"resumed from step {run.start_step} ({checkpoints.path(run.start_step)}), "
                   f"data position {run.stream.position}")
        if window and window[0] <= run.start_step:  # a trace opens before the window's first step
            notice(f"--profile-steps {profile_steps} starts before step {run.start_step + 1}, where this run "
                   "resumes: nothing is profiled")
        if run.start_step >= cfg.steps:
            if main:
                console.print(f"nothing to do: the checkpoint is at step {run.start_step} and --steps is "
                              f"{cfg.steps}")
            distributed.finish()
            return
        for change in changes if run.start_step else ():  # a fresh start (--allow-fresh) changes nothing
            notice(change)
        from shard.train.state import warmup_steps

        cut = warmup_steps(cfg.optimizer, cfg.steps)
        if cut < cfg.optimizer.warmup_steps and cfg.steps > 1:  # the schedule's cut, said
            notice(f"optimizer.warmup_steps {cfg.optimizer.warmup_steps} is not below --steps {cfg.steps}: the "
                   f"warmup is cut to {cut} step{'s' if cut != 1 else ''}, so the learning rate peaks at the last step")
        if run.start_step and resumed and cfg.init_from != base.get("init_from", ""):
            # the run's own checkpoint was read: the weights it started from stay the ones on record
            if weights:
                notice(f"init_from {weights} is not read: the run resumes from its own checkpoint")
            cfg = dataclasses.replace(cfg, init_from=base.get("init_from", ""))
        cfg = dataclasses.replace(cfg, run_dir=str(path))
        config_toml = config_mod.to_toml(cfg)
        observers, found = [], set()
        if main:  # only process 0 prints and writes the run's files
            found = {name for name in start_files() if (path / name).exists()}  # never removed below
            path.mkdir(parents=True, exist_ok=True)
            lock.acquire()
            if not existed and holds_run(path):  # another train made it (and may have ended) meanwhile
                raise ShardError(f"run dir {path} was started by another shard train while this one "
                                 "prepared; run the command again (with --resume to continue that run)")
        finished = False
        try:
            if main:
                from shard.run import hf

                if cfg.init_from and not run.start_step and not {"config.toml", hf.SIDE_DIR} & found:
                    # what export-hf writes back besides the weights, from the weights a first start read
                    hf.keep_side_files(cfg.init_from, path)
                write_text_atomic(path / "config.toml", config_toml)
                observers = [ConsoleProgress(cfg, path), JsonlWriter(path / "metrics.jsonl"),
                             TensorBoardWriter(path / "tb")]
            saver = SaveCheckpoints(checkpoints, seed=cfg.seed, config_toml=config_toml)
            stopper = StopOnSignal(notice)
            # every process saves its shards (the MPI bridge: process 0); observers end last started first,
            # so the saver waits for the final save while the stopper's handlers still take the signals
            observers += [stopper, saver]
            if window and main:
                observers.append(profiler := profiling.Profiler(*window, path / "profile"))
            train_loop(cfg, run=run, observers=observers)
            finished = True
        finally:  # also on divergence: saves already under way commit; nothing newer is written
            checkpoints.close()
            if not finished and main and not run.start_step:  # a first start (--resume --allow-fresh too)
                forget_unstarted_run(path, found)
    except ShardError:
        raise
    except KeyboardInterrupt:  # Ctrl-C before the loop took the signals, or a second one: out at once
        if main:
            done = step_dirs(checkpoints.directory)  # on disk: a save under way may have finished
            newest = checkpoints.path(done[-1]) if done else "none"
            if stopper is not None and stopper.received:
                err_console.print(f"interrupted again: stopped at once, without waiting for the save; the newest "
                                  f"complete checkpoint is {newest} (an unfinished one is removed by --resume)",
                                  soft_wrap=True)
            else:
                err_console.print(f"interrupted: stopped at once; the newest complete checkpoint is {newest}",
                                  soft_wrap=True)
        raise SystemExit(130) from None
    except Exception as e:  # a lost peer surfaces as a runtime error in a collective
        if user_error(e) is not None:
            raise  # this process's own error (out of memory, a full disk), not a lost peer's
        distributed.fail(e)  # several processes: names the lost one and exits; one process: re-raises
    if window and main and profiler.summary:
        console.print(profiling.format_summary(profiler.summary), soft_wrap=True)
    if run.stopped_at is not None and main:
        where = checkpoints.path(saver.last_saved) if saver.last_saved else "(no checkpoint)"
        console.print(f"stopped by {stopper.received or 'a signal on another process'} after step "
                      f"{run.stopped_at}; checkpoint saved to {where}; "
                      f"continue with: {continue_command(path, cluster)}", soft_wrap=True)
    distributed.finish()


@app.command()
def export(
    out: Annotated[Path, typer.Option("--out", help="new directory for the params-only orbax checkpoint")],
    checkpoint: CheckpointArg = None,
    checkpoint_opt: CheckpointOpt = None,
):
    """Write a checkpoint's params alone, as a plain orbax checkpoint for code outside shard.

    shard's own generate, eval and --init-from read the training checkpoint itself."""
    from shard.run.checkpoint import export_params

    target, step = export_params(Path(_checkpoint_given(checkpoint, checkpoint_opt)), out)
    console.print(f"exported the params of step {step} to {target}")


@app.command()
def inspect(
    mesh: MeshOpt = None,
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the table as JSON")] = False,
    compiled: Annotated[bool, typer.Option("--compiled", help="also compile the train step (from shapes) and "
                                           "report its collectives, communication efficiency and memory")] = False,
    batch: Annotated[int | None, typer.Option(help="global batch, in sequences (with --compiled)")] = None,
    seq: Annotated[int | None, typer.Option(help="sequence length (with --compiled)")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    simulate_devices: SimOpt = None,
):
    """Every parameter's shape, logical axes, PartitionSpec and bytes per device, from shapes alone."""
    cfg = config_mod.resolve(_overrides(_config_file(config), set_, mesh=mesh, model=model, batch=batch, seq=seq,
                                        simulate_devices=simulate_devices))
    mesh_spec = parse_mesh(cfg.mesh.spec)
    devices = start_devices(cfg, mesh_spec)
    from shard.measure.inspection import summary
    from shard.sharding.layout import make_layout
    from shard.train.state import state_spec

    layout = make_layout(cfg, mesh_spec, devices)
    doc = summary(state_spec(cfg.model, cfg.optimizer, cfg.steps, layout), layout)
    doc["model"] = cfg.model.name
    if compiled:
        from shard.measure.analysis import analyze
        from shard.train.step import check_batch

        check_batch(cfg, layout)
        doc["batch"], doc["seq_len"] = cfg.data.batch, cfg.data.seq_len
        doc.update(analyze(cfg, layout).to_dict())
    if as_json:
        print(json.dumps(doc, indent=1))
        return
    table = Table(title=f"{cfg.model.name} on mesh " + ",".join(f"{k}={v}" for k, v in doc["mesh"].items()))
    for col in ("parameter", "shape", "logical axes", "PartitionSpec", "per device"):
        table.add_column(col, justify="right" if col == "per device" else "left")
    for r in doc["params"]:
        spec = "(" + ", ".join("None" if e is None else e if isinstance(e, str) else "(" + ", ".join(e) + ")"
                               for e in r["partition_spec"]) + ")"
        table.add_row(r["name"], "x".join(map(str, r["shape"])), ", ".join(a or "-" for a in r["logical_axes"]), spec,
                      human_bytes(r["bytes_per_device"]))
    console.print(table)
    console.print(f"{doc['param_count'] / 1e6:,.2f}M parameters · per device: params "
                  f"{human_bytes(doc['params_bytes_per_device'])}, optimizer state "
                  f"{human_bytes(doc['opt_state_bytes_per_device'])}")
    if compiled:
        _print_compiled(doc)


def _print_compiled(doc: dict) -> None:
    table = Table(title=f"collectives per step (batch {doc['batch']}x{doc['seq_len']}, {doc['platform']})")
    for col in ("kind", "mesh axes", "compiled as", "count", "bytes/device", "as compiled"):
        table.add_column(col, justify="right" if col in ("count", "bytes/device", "as compiled") else "left")
    bounded = {a for r in doc["collectives"] if r["upper_bound"] for a in r["axes"]}  # counted as if every branch ran
    for r in doc["collectives"]:
        table.add_row(r["kind"], "+".join(r["axes"]), r["compiled_as"], f"{'<=' if r['upper_bound'] else ''}{r['count']}",
                      human_bytes(r["bytes_per_device"]), human_bytes(r["compiled_bytes_per_device"]))
    Console(highlight=False, emoji=False, markup=False, width=max(console.width, 110)).print(table)
    if bounded:
        console.print("<=: in a conditional's branches (the 1F1B schedule's switch), counted as if every branch ran "
                      "on every call: an upper bound", soft_wrap=True)
    moved = lambda axis: ("at most " if axis in bounded else "") + human_bytes(doc["bytes_per_axis"].get(axis, 0))  # noqa: E731
    for axis, eff in doc["communication_efficiency"].items():
        console.print(f"axis {axis}: moved {moved(axis)}, analytic minimum "
                      f"{human_bytes(doc['minimum_bytes_per_axis'].get(axis, 0))}, efficiency {eff:.3f}"
                      + (" (a lower bound)" if axis in bounded else ""))
    for axis, parallelism in doc["unmodelled_axes"].items():
        console.print(f"axis {axis}: moved {moved(axis)}, no analytic minimum ({parallelism} has no formula yet)")
    m = doc["memory"]
    console.print(f"memory per device {human_bytes(m['total'])} (arguments {human_bytes(m['arguments'])} + temporaries "
                  f"{human_bytes(m['temporaries'])} + outputs {human_bytes(m['outputs'])} - aliased {human_bytes(m['aliased'])}) · "
                  f"model FLOPs/device {doc['model_flops_per_device']:.3g} (XLA's cost analysis: "
                  f"{doc['flops_per_device']:.3g}, counting each loop body once, so one scanned layer)")


@app.command()
def plan(
    model: Annotated[str, typer.Option("--model", help="model preset")] = "llama-13b-24l",
    devices: Annotated[int, typer.Option("--devices", help="accelerators in all")] = 8,
    nodes: Annotated[int, typer.Option("--nodes", help="nodes they sit in (tensor parallel stays inside one)")] = 1,
    hardware: Annotated[str, typer.Option("--hardware", help="h100, h200, h100-pcie, h100-nvl, h200-nvl, a100-40g, a100-80g, cpu, or yours")] = "h100",
    hardware_file: Annotated[Path | None, typer.Option("--hardware-file", help="TOML with more hardware")] = None,
    seq: Annotated[int, typer.Option(help="sequence length")] = 2048,
    batch: Annotated[int | None, typer.Option(help="global batch in sequences (default: 2 per device)")] = None,
    top: Annotated[int, typer.Option(help="rows to print")] = 12,
    as_json: Annotated[bool, typer.Option("--json", help="print every layout as JSON")] = False,
    set_: PlanSetOpt = None,
):
    """Rank the layouts of a model on a cluster by predicted step time, from the analytic cost model."""
    from shard.hardware import find_hardware, load_hardware
    from shard.measure.plan import REMAT_CHOICES
    from shard.measure.plan import plan as make_plan

    sets = config_mod.parse_sets(set_ or [])
    if set(sets) - {"model"}:
        raise ShardError(f"plan takes model.* keys in --set (the rest from its flags: --batch, --seq, ...), got "
                         f"{sorted(set(sets) - {'model'})[0]}.*")
    cfg = config_mod.resolve(config_mod.merge({"model": {"name": model}}, sets))
    hw = find_hardware(hardware, load_hardware(hardware_file))
    if top < 0:
        raise ShardError(f"--top must be 0 or more, got {top}")
    global_batch = 2 * devices if batch is None else batch
    # A remat policy given with --set is planned alone; the other model keys go into the best command.
    remats = (cfg.model.remat,) if "remat" in sets.get("model", {}) else REMAT_CHOICES
    passed_on = tuple(item.strip() for item in set_ or ()
                      if item.partition("=")[0].strip() not in ("model.remat", "model.name"))
    ranked = make_plan(cfg.model, devices, nodes, hw, global_batch, seq, remats)
    best = next((c for c in ranked if c.fits), None)
    if as_json:
        print(json.dumps({"model": cfg.model.name, "devices": devices, "nodes": nodes, "hardware": hw.name,
                          "batch": global_batch, "seq_len": seq,
                          "warnings": [_MOE_NOT_PLANNED] if cfg.model.n_experts else [],
                          "best": best.command(cfg.model.name, global_batch, seq, passed_on) if best else None,
                          "layouts": [c.to_dict() for c in ranked]}, indent=1))
        if best is None:
            raise typer.Exit(1)
        return
    console.print(f"{cfg.model.name} ({param_count(cfg.model.num_params())} params) on {devices} x {hw.name} in "
                  f"{nodes} node(s) · batch {global_batch} x {seq} tokens · {hw.description}")
    columns = ("mesh", "remat", "mem/dev", "comm/step (* crosses nodes)", "step", "serial", "MFU", "fits")
    rows = []
    for c in ranked[:top]:
        comm = " ".join(f"{a}{'*' if c.crosses_nodes.get(a) else ''}={short_bytes(b)}" for a, b in c.comm_bytes.items())
        rows.append((c.mesh_spec(), c.remat, short_bytes(c.memory["total"]), comm or "-", f"{c.step_s:.2f}s",
                     f"{c.step_s_serial:.2f}s", f"{c.mfu:.0%}", "yes" if c.fits else "; ".join(c.problems)))
    table = Table(box=None, pad_edge=False)
    for i, col in enumerate(columns):
        if col == "fits":  # the problems, however long, fold under their column; the figures stay whole
            table.add_column(col, overflow="fold", min_width=12)
        else:
            table.add_column(col, justify="right" if col in ("mem/dev", "step", "serial", "MFU") else "left",
                             no_wrap=True, min_width=max(len(r[i]) for r in [columns, *rows]))
    for row in rows:
        table.add_row(*row)
    Console(highlight=False, emoji=False, markup=False, width=max(console.width, 150)).print(table)
    fitting = sum(c.fits for c in ranked)
    console.print(f"{fitting} of {len(ranked)} layouts fit · * = the axis crosses nodes")
    if cfg.model.n_experts:  # with the table, before the best: that best is not weighed against expert parallel
        console.print(f"warning: {_MOE_NOT_PLANNED}", soft_wrap=True)
    if best:
        console.print(f"best: {best.command(cfg.model.name, global_batch, seq, passed_on)}", soft_wrap=True)  # one line to copy
    else:
        batch_ways = [next((int(m.group(1)) for p in c.problems
                            if (m := re.search(r"global batch \d+ does not split over (\d+) data-parallel", p))), None)
                      for c in ranked]
        if ranked and None not in batch_ways:  # no layout splits the batch, whatever its memory
            fewest = min(batch_ways)
            console.print(f"no layout fits: --batch {global_batch} splits over the data-parallel devices of none "
                          f"of them (the fewest are {fewest}); use a multiple of {fewest}", soft_wrap=True)
        else:
            console.print("no layout fits: add devices, shorten --seq, or lower --batch")
        raise typer.Exit(1)  # like grep with no match: the table is the answer, the status is for scripts


bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Measure the machine.")
app.add_typer(bench_app, name="bench")


@bench_app.command("collectives")
def bench_collectives(
    mesh: MeshOpt = None,
    min_size: Annotated[int, typer.Option("--min-size", help="smallest message, bytes")] = 1024,
    max_size: Annotated[int, typer.Option("--max-size", help="largest message, bytes")] = 64 * 1024 * 1024,
    iters: Annotated[int, typer.Option(help="timed runs per point (median)")] = 5,
    kinds: Annotated[list[str] | None, typer.Option("--kind", help="only these collectives")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON lines")] = False,
    simulate_devices: SimOpt = None,
):
    """All-reduce, all-gather, reduce-scatter, all-to-all and permute over each mesh axis: time,
    algorithm bandwidth and bus bandwidth as nccl-tests computes them."""
    from shard.measure.hlo import KINDS

    cfg = config_mod.resolve(_overrides({}, None, mesh=mesh, simulate_devices=simulate_devices))
    mesh_spec = parse_mesh(cfg.mesh.spec)
    for k in kinds or ():
        if k not in KINDS:
            raise ShardError(f"unknown collective {k!r} (known: {', '.join(KINDS)})")
    if min_size <= 0 or max_size < min_size:
        raise ShardError("--min-size must be positive and at most --max-size")
    if iters <= 0:
        raise ShardError(f"--iters must be positive, got {iters}")
    if all(n == 1 for n in mesh_spec.shape):  # from the flag alone (a -1 size may fill several devices)
        raise ShardError(f"mesh {mesh_spec.describe()} has no axis of size > 1: nothing to measure; give a mesh "
                         "with one, e.g. --mesh 8x1")
    devices = start_devices(cfg, mesh_spec)
    from shard.measure.bench import bench, sizes_between
    from shard.sharding.mesh import build_mesh

    jmesh = build_mesh(mesh_spec, devices)
    table, noted = None, []
    if not as_json:
        table = Table(title="collectives (nccl-tests conventions; GB/s = 1e9 B/s)")
        for col in ("collective", "axis", "n", "size", "time", "algbw GB/s", "busbw GB/s"):
            table.add_column(col, justify="left" if col in ("collective", "axis") else "right")

    def show(r):
        if r["size_bytes"] != r["asked_bytes"] and not noted:  # whole float32s, at least one per device
            noted.append(r)
            err_console.print(f"[yellow]sizes are rounded to whole float32 elements, at least one per device of "
                              f"the axis: {human_bytes(r['asked_bytes'])} asked, {human_bytes(r['size_bytes'])} "
                              f"measured ({r['kind']} over {r['axis']})[/yellow]", soft_wrap=True)
        if as_json:
            print(json.dumps(r), flush=True)
        else:
            table.add_row(r["kind"], r["axis"], str(r["devices"]), human_bytes(r["size_bytes"]),
                          f"{r['time_us']:.1f}us", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}")

    if not bench(jmesh, sizes_between(min_size, max_size), tuple(kinds or KINDS), iters, on_result=show):
        raise ShardError(f"mesh {mesh_spec.describe(tuple(jmesh.shape.values()))} has no axis of size > 1 on "
                         f"{len(devices)} device(s): nothing to measure")
    if table is not None:
        Console(highlight=False, emoji=False, markup=False, width=max(console.width, 110)).print(table)


@app.command()
def report(
    run_dirs: Annotated[list[str], typer.Argument(help="run directories to compare")],
    out: Annotated[Path | None, typer.Option("--out", help="where the PNGs go (default: report/; with --json, "
                                                       "only when given)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the table as JSON")] = False,
):
    """Plots of loss and throughput (runs overlaid) and a table: layout, final loss, tokens/s, MFU, memory."""
    from shard.observe.report import report as make_report

    if out is not None:
        check_outside_checkpoints(out)
    doc = make_report(run_dirs, out if out is not None or as_json else Path("report"))  # --json: stdout only
    if as_json:
        print(json.dumps(doc, indent=1))
        return
    table = Table(title="runs")
    for col in ("run", "layout", "steps", "final loss", "median tokens/s", "MFU", "peak memory/device"):
        table.add_column(col, overflow="fold")  # run paths whole, never "/tmp/ru…"
    for r in doc["runs"]:
        mem = human_bytes(r["peak_memory_bytes"]) + (" (compiled)" if r["memory_source"] == "compiled" else "") \
            if r["peak_memory_bytes"] is not None else "-"
        loss = "-" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        table.add_row(r["run"], r["layout"], str(r["steps"]), loss, f"{r['median_tokens_per_s']:,.0f}",
                      "-" if r["mfu"] is None else f"{r['mfu']:.1%}", mem)
    # at least 120 columns, as plan's table: in 80 a column's heading shrank to "e"; paths are not markup
    Console(highlight=False, emoji=False, markup=False, width=max(console.width, 120)).print(table)
    for r in doc["runs"]:
        if r["skipped_lines"]:
            err_console.print(f"[yellow]{escape(r['run'])}: skipped {r['skipped_lines']} line(s) of metrics.jsonl that "
                              "are not complete records (a run killed mid-write?)[/yellow]", soft_wrap=True)
        if r["config_problem"]:
            err_console.print(f"[yellow]{escape(r['run'])}: {escape(r['config_problem'])}, so its model and layout "
                              "are shown as ?[/yellow]", soft_wrap=True)
    console.print("plots: " + ", ".join(doc["plots"]), soft_wrap=True)


def _host_jax(mesh: str = "1x1", simulate_devices: int | None = None, sets: list[str] | None = None):
    """Start JAX for a command that only needs a mesh (generate, import/export): devices as for train."""
    cfg = config_mod.resolve(_overrides({}, sets, mesh=mesh, simulate_devices=simulate_devices))
    spec = parse_mesh(cfg.mesh.spec)
    return cfg, spec, start_devices(cfg, spec)


@app.command()
def generate(
    checkpoint: Annotated[str | None, typer.Argument(help="a shard checkpoint or run dir, or a Hugging Face folder", show_default=False)] = None,
    checkpoint_opt: CheckpointOpt = None,
    prompt: Annotated[str | None, typer.Option(help="prompt text (byte-level models)")] = None,
    prompt_ids: Annotated[str | None, typer.Option("--prompt-ids", help="prompt as token ids: 5,17,99")] = None,
    prompts_file: Annotated[Path | None, typer.Option("--prompts-file", help="one prompt per line")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 64,
    temperature: Annotated[float, typer.Option(help="0: greedy")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0: off")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="1: off")] = 1.0,
    seed: int = 0,
    mesh: Annotated[str, typer.Option(help="mesh to generate on (tensor parallel: 1x4, ...)")] = "1x1",
    ids: Annotated[bool, typer.Option("--ids", help="print generated token ids instead of text")] = False,
    simulate_devices: SimOpt = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="a sharding rule: --set rules.kv_heads=none")] = None,
):
    """Sample from a model with a KV cache on a mesh, streaming tokens as they come."""
    import codecs

    checkpoint = _checkpoint_given(checkpoint, checkpoint_opt)

    others = set(config_mod.parse_sets(set_ or [])) - {"rules", "param_rules", "param_regex"}
    if others:
        raise ShardError(f"generate takes rules.*, param_rules.* and param_regex.* in --set (the model comes with "
                         f"the checkpoint), got {sorted(others)[0]}")

    given = [x for x in (prompt, prompt_ids, prompts_file) if x is not None]
    if len(given) != 1:
        raise ShardError("give exactly one of --prompt, --prompt-ids or --prompts-file")
    if not 0 <= max_new_tokens < 2**31:
        raise ShardError(f"--max-new-tokens must be 0 or more and below 2**31, got {max_new_tokens}")
    if not 0 <= seed < 2**32:  # as train's
        raise ShardError(f"--seed must be between 0 and 2**32-1, got {seed}")
    texts = _prompt_texts(prompt, prompts_file) if prompt_ids is None else []
    tcfg, mesh_spec, devices = _host_jax(mesh, simulate_devices, set_)
    from shard.run import weights
    from shard.data.tokenizers import ByteTokenizer
    from shard.train.generate import Generator, Sampling
    from shard.sharding.layout import make_layout
    from shard.train.state import state_spec

    sampling = Sampling(temperature, top_k, top_p)
    sampling.validate()  # before the weights are read

    model_cfg, params = weights.load(checkpoint)
    byte_level = model_cfg.vocab_size == ByteTokenizer.vocab_size
    if not byte_level and not (ids and prompt_ids is not None):
        raise ShardError(f"this model has a {model_cfg.vocab_size}-token vocabulary and shard has no "
                         "tokenizer for it: use --prompt-ids and --ids")
    if prompt_ids is not None:
        prompts = [_parse_ids(prompt_ids, model_cfg.vocab_size)]
    else:
        prompts = [ByteTokenizer().encode(t).tolist() for t in texts]
    tcfg = dataclasses.replace(tcfg, model=model_cfg)
    layout = make_layout(tcfg, mesh_spec, devices)
    spec = state_spec(model_cfg, tcfg.optimizer, 1, layout)
    gen = Generator(model_cfg, spec.graphdef, weights.place(params, spec), layout,
                    max_len=max(len(p) for p in prompts) + max_new_tokens)
    for n, p in enumerate(prompts):
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if ids:
            emit = lambda t: print(t, end=" ", flush=True)  # noqa: E731
        else:
            print(ByteTokenizer().decode(p), end="", flush=True)
            emit = lambda t: print(decoder.decode(bytes([t])), end="", flush=True)  # noqa: E731, B023 - used in this loop turn
        try:
            gen.generate(p, max_new_tokens, sampling, seed=seed + n, on_token=emit)
        except BaseException:  # out of memory, Ctrl-C: the error line starts on a line of its own
            print(flush=True)
            raise
        print("" if ids else decoder.decode(b"", final=True), flush=True)  # an unfinished character: U+FFFD


@app.command("eval")
def evaluate(
    checkpoint: Annotated[str | None, typer.Argument(help="a shard checkpoint or run dir, or a Hugging Face folder", show_default=False)] = None,
    checkpoint_opt: CheckpointOpt = None,
    data: Annotated[str | None, typer.Option(help="text file or folder to score (default: the run's held-out data)")] = None,
    batches: Annotated[int | None, typer.Option(help="global batches (default: the run's eval.batches)")] = None,
    batch: Annotated[int | None, typer.Option(help="global batch (default: the run's data.batch)")] = None,
    seq: Annotated[int | None, typer.Option(help="sequence length (default: the run's data.seq_len)")] = None,
    mesh: Annotated[str, typer.Option(help="mesh to evaluate on")] = "1x1",
    json_out: Annotated[bool, typer.Option("--json", help="print the figures as JSON")] = False,
    simulate_devices: SimOpt = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="a sharding rule: --set rules.vocab=none")] = None,
):
    """Held-out loss and perplexity of a checkpoint: the run's held-out data (as its evaluations saw
    it) or --data."""
    checkpoint = _checkpoint_given(checkpoint, checkpoint_opt)
    others = set(config_mod.parse_sets(set_ or [])) - {"rules", "param_rules", "param_regex"}
    if others:
        raise ShardError(f"eval takes rules.*, param_rules.* and param_regex.* in --set (the model comes with "
                         f"the checkpoint), got {sorted(others)[0]}")
    for name, value in (("--batches", batches), ("--batch", batch), ("--seq", seq)):
        if value is not None and value < 1:
            raise ShardError(f"{name} must be positive, got {value}")
    from shard.run import weights
    from shard.train.evaluate import held_out_source, summed_loss

    if not Path(checkpoint).exists():
        raise ShardError(f"weights path {checkpoint} does not exist")
    saved, source = held_out_source(weights.saved_run_config(checkpoint), data, checkpoint,
                                    weights.held_out_since(checkpoint))
    batch, seq = batch or saved.data.batch, seq or saved.data.seq_len
    batches = batches or saved.eval.batches
    tcfg, mesh_spec, devices = _host_jax(mesh, simulate_devices, set_)
    from shard.data.batches import BatchStream, eval_samples
    from shard.train.step import check_batch
    from shard.sharding.layout import make_layout
    from shard.train.state import state_spec
    from shard.train.step import batch_sharding, make_eval_step

    model_cfg, params = weights.load(checkpoint)
    cfg = dataclasses.replace(saved, model=model_cfg, data=dataclasses.replace(saved.data, batch=batch, seq_len=seq))
    layout = make_layout(dataclasses.replace(tcfg, model=model_cfg), mesh_spec, devices)
    check_batch(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, microbatches=1)), layout)  # and --seq
    samples = eval_samples(cfg)
    if samples.windows is not None and samples.windows < batch:
        raise ShardError(f"the data holds {samples.windows} window(s) of {seq + 1} tokens, fewer than one batch of "
                         f"{batch}: give a smaller --batch (a multiple of the mesh's {layout.degree('batch')} "
                         "data-parallel devices) or a shorter --seq")
    if samples.windows is not None and samples.windows < batches * batch:  # none scored twice
        batches = samples.windows // batch
        err_console.print(f"[yellow]the data holds {samples.windows} window(s) of {seq + 1} tokens: scoring "
                          f"{batches} batch(es) of {batch}[/yellow]", soft_wrap=True)
    spec = state_spec(model_cfg, tcfg.optimizer, 1, layout)
    stream = BatchStream(samples, batch, seq, batch_sharding(layout))
    nll, tokens = summed_loss(make_eval_step(spec, layout), weights.place(params, spec), stream, batches)
    loss = float(nll / max(tokens, 1.0))
    figures = {"eval_loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(tokens),
               "batches": batches, "batch": batch, "seq_len": seq, "data": source}
    if json_out:
        print(json.dumps(figures))
    else:
        console.print(f"eval loss {loss:.4f} (perplexity {figures['perplexity']:,.2f}) over {batches} batch(es) of "
                      f"{batch} x {seq} ({int(tokens):,} tokens) of {escape(source)}", soft_wrap=True)


def _prompt_texts(prompt: str | None, prompts_file: Path | None) -> list[str]:
    """The prompts to sample from: --prompt, or each line of --prompts-file (which must hold one)."""
    if prompt is not None:
        return [prompt]
    if not prompts_file.is_file():
        raise ShardError(f"prompts file {prompts_file} not found" if not prompts_file.exists()
                         else f"prompts file {prompts_file} is not a file")
    try:
        text = prompts_file.read_text()
        # lines end at a newline only (str.splitlines also splits at a form feed, which is text here)
        lines = [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")]
    except UnicodeDecodeError:
        raise ShardError(f"prompts file {prompts_file} is not UTF-8 text") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ShardError(f"prompts file {prompts_file} holds no prompt (one per line)")
    if len(prompts) < len(lines):
        err_console.print(f"[dim]skipping {len(lines) - len(prompts)} blank line(s) of {escape(str(prompts_file))}[/dim]")
    return prompts


def _parse_ids(text: str, vocab_size: int) -> list[int]:
    """--prompt-ids: comma-separated token ids, each in the model's vocabulary."""
    parts = [t.strip() for t in text.strip().removesuffix(",").split(",")]
    if not all(p.lstrip("-").isdigit() for p in parts):
        raise ShardError(f"--prompt-ids expects comma-separated integers like 5,17,99, got {text!r}")
    ids = [int(p) for p in parts]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ShardError(f"--prompt-ids: token id {bad[0]} is outside the model's vocabulary 0..{vocab_size - 1}")
    return ids


@app.command("import-hf")
def import_hf(
    hf_dir: Annotated[Path, typer.Argument(help="a local Hugging Face Llama folder (config.json + *.safetensors)")],
    out: Annotated[Path, typer.Option("--out", help="run dir to create with the imported checkpoint")],
):
    """Import a Hugging Face Llama-family model as a shard checkpoint (step 0, fresh optimizer state)."""
    from shard.run.hf import is_hf_dir

    if not is_hf_dir(hf_dir):
        what = "does not exist" if not hf_dir.exists() else "is a file" if not hf_dir.is_dir() else \
            "has a config.json that is not a file" if (hf_dir / "config.json").exists() else "holds no config.json"
        raise ShardError(f"{hf_dir} {what}: give a Hugging Face Llama folder (config.json and *.safetensors)")
    check_fresh_out(out)
    tcfg, mesh_spec, devices = _host_jax("1x1")
    from shard.run import hf, weights
    from shard.run.checkpoint import Checkpoints
    from shard.sharding.layout import make_layout
    from shard.train.state import state_spec

    model_cfg, params = weights.load(hf_dir)
    tcfg = dataclasses.replace(tcfg, model=model_cfg, run_dir=str(out))
    layout = make_layout(tcfg, mesh_spec, devices[:1])
    spec = state_spec(model_cfg, tcfg.optimizer, 1, layout)
    restored = weights.state_from(params, spec, tcfg.seed, str(hf_dir))
    globless(out.absolute())
    config_toml = config_mod.to_toml(tcfg)
    with written_whole(out) as partial:  # a full disk leaves nothing behind
        ckpts = Checkpoints(partial / CHECKPOINTS_DIR, tcfg.checkpoint)
        (partial / "config.toml").write_text(config_toml)
        hf.keep_side_files(hf_dir, partial)  # token ids, context length, tokenizer: for export-hf
        try:
            ckpts.save(0, restored.state, position=0, seed=tcfg.seed, config_toml=config_toml)
            ckpts.wait()
        finally:
            ckpts.close()
    console.print(f"imported {hf_dir} ({model_cfg.num_params() / 1e6:,.1f}M parameters) into {out}; "
                  f"fine-tune with: shard train --init-from {out} ...", soft_wrap=True)


@app.command("export-hf")
def export_hf(
    out: Annotated[Path, typer.Option("--out", help="folder to write config.json and safetensors into")],
    checkpoint: CheckpointArg = None,
    checkpoint_opt: CheckpointOpt = None,
):
    """Write a checkpoint's model as a Hugging Face Llama folder that transformers loads."""
    checkpoint = _checkpoint_given(checkpoint, checkpoint_opt)
    check_fresh_out(out)
    _host_jax()
    from shard.run import hf, weights

    model_cfg, params = weights.load(checkpoint)
    with written_whole(out) as partial:  # a full disk leaves nothing behind
        files = hf.write_hf_dir(str(partial), model_cfg, params, side=hf.side_files_of(checkpoint))
    console.print(f"wrote {out}/config.json and {len(files)} safetensors file(s)", soft_wrap=True)


_MOE_NOT_PLANNED = ("a mixture of experts is planned over data, fsdp and expert axes only: tensor and context "
                    "parallel have no formula for its layers")


def main() -> None:
    """The CLI without the huge-page restart (shard.cli.entry:main, the `shard` command, does that first)."""
    app()


if __name__ == "__main__":
    main()
