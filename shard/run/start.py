"""How a training run starts: the config it resolves (flags over a resumed run's saved config or the
model of the weights it starts from) and the run dir it claims and locks (its devices: shard.run.devices).

Nothing here prints: what is worth saying goes to a `notice` (or `warn`, `note`) callable, so the
command line decides how it looks and the functions can be tested without it. No JAX at import: the
device count must be settled before JAX starts.
"""

import dataclasses
import glob as globmod
from collections.abc import Callable
from pathlib import Path

from shard import config as config_mod
from shard.errors import ShardError
from shard.paths import CHECKPOINTS_DIR, RunDirLock, globless, remove_made_folders, write_text_atomic
from shard.run.resume import check_hf_model_is_preset, init_from_base, resume_base, resume_changes
from shard.run.devices import Notice, unsaid
from shard.run.run_dir import choose_run_dir, forget_unstarted_run, holds_run, start_files
from shard.sharding.mesh import MeshSpec, rename_mesh_file, split_mesh_file


@dataclasses.dataclass(frozen=True)
class StartConfig:
    """A run's config as resolved for this start, and what it was built on."""

    cfg: config_mod.TrainConfig
    base: dict | None  # a resumed run's saved config, or {"model": ...} of the weights it starts from
    resumed: bool  # --resume found the run's config (not a first start)
    weights: str  # the init_from the start was given ("" for none), as given
    changes: tuple[str, ...]  # what a resume changes: said once a checkpoint is read (process 0 only)
    source: object = None  # its data described once (shard.data.sources.DataSource), for all that reads it


def resolve_start(layers: Callable[[dict | None], dict], from_file: dict, sets: list[str] | None, *,
                  run_dir: str | None, init_from: str | None, resume: bool, allow_fresh: bool,
                  cluster=None, notice: Notice = unsaid) -> StartConfig:
    """The config a `shard train` start runs with. `layers(base)` stacks the config file, the flags and
    --set over `base` (a resumed run's saved config, or the model of the --init-from weights);
    `run_dir` is the run dir the start names (`run_dir_named`); `from_file` and `sets` say where the
    init_from comes from. Notes the
    cluster's settings for the errors before it is joined (shard.cluster.runtime.expect)."""
    from shard.cluster import runtime
    from shard.run.hf_side import context_note

    main = cluster is None or cluster.process_id == 0
    base = resume_base(run_dir, allow_fresh, notice=notice if main else None) if resume else None
    resumed = bool(base)  # the run dir holds a run's config
    weights = init_from_given(init_from, from_file, sets)
    if weights and not resumed:  # a new run, or the first start of a --resume --allow-fresh one
        base = init_from_base(weights)
    overrides = layers(base)
    cfg = config_mod.resolve(overrides)
    _check_saved_model(cfg, base, resumed, weights, run_dir)
    _check_task(cfg, layers(None), from_file)
    runtime.expect(cluster, cfg.cluster.cross_host, cfg.cluster.failure_timeout, cfg.cluster.join_timeout)
    if cluster is None and cfg.cluster.cross_host == runtime.MPI:
        notice("--cross-host mpi: no launcher started other processes (mpiexec -n N, or srun), so this is one "
               "process")
    cfg = absolute_paths(cfg)
    if weights and not resumed:  # a resumed run reads with the tokenizer on record
        from shard.run.tokenizer import with_weights_tokenizer

        cfg = with_weights_tokenizer(cfg)
    cfg, source = _vocab_of_tokenizer(cfg, overrides, notice if main else unsaid)
    changes = resume_changes(base, cfg) if resumed and main else []
    if weights and not resumed and main and (note := context_note(cfg.init_from, cfg.data.seq_len)):
        notice(note)
    return StartConfig(cfg, base, resumed, weights, tuple(changes), source)


def _check_task(cfg: config_mod.TrainConfig, given: dict, from_file: dict) -> None:
    """What a fine-tuning task would otherwise ignore, or start from without a word (`given`: the keys the
    config file, the flags and --set name). A packing the config file alone names is let be: a run's
    saved config.toml names every key."""
    packing = (given.get("data") or {}).get("packing")
    if packing == (from_file.get("data") or {}).get("packing"):
        packing = None
    if cfg.task == "sft" and packing == "concat":
        raise ShardError("task sft packs conversations into rows with attention and positions restarting at each "
                         "(as --packing packed does); --packing concat, which runs them into each other, does not "
                         "apply: leave --packing out")
    if cfg.task in ("dpo", "grpo") and packing is not None:
        raise ShardError(f"task {cfg.task} gives each sequence a row of its own, padded: --packing does not apply; "
                         "leave it out")
    if cfg.task == "dpo" and not cfg.init_from:
        raise ShardError("task dpo needs --init-from: its reference model is the weights the run starts from (as TRL's "
                         "DPOTrainer copies the model it is given), and a random initialisation is no model to "
                         "prefer answers against; --init-from an SFT run, a checkpoint or a Hugging Face folder")


def _vocab_of_tokenizer(cfg: config_mod.TrainConfig, overrides: dict, notice: Notice):
    """(cfg, its data's description): the model's vocabulary from the data's tokenizer, unless the config
    sets it (the user, a resumed run's saved config, the weights it starts from); said in a notice."""
    from shard.data.corpus import fit_vocab
    from shard.data.sources import data_source

    source = data_source(cfg)  # the one look at the data a run takes: everything after reads this
    model = overrides.get("model")
    cfg, note = fit_vocab(cfg, isinstance(model, dict) and "vocab_size" in model, source)
    if note:
        notice(note)
    return cfg, source


def run_dir_named(run_dir: str | None, from_file: dict, resume: bool) -> str | None:
    """The run dir a start names: --run-dir, else with --resume the one the --config file names."""
    if resume and run_dir is None:
        return from_file.get("run_dir") or None
    return run_dir


def init_from_given(flag: str | None, from_file: dict, sets: list[str] | None) -> str:
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


def _check_saved_model(cfg: config_mod.TrainConfig, base: dict | None, resumed: bool, weights: str,
                       run_dir: str | None) -> None:
    """The model named must be the one the saved config or the weights hold: their weights load into
    no other."""
    from shard.run.hf_config import is_hf_dir

    saved_name = (base or {}).get("model", {}).get("name")
    if not saved_name or cfg.model.name == saved_name:
        return
    if weights and not resumed and is_hf_dir(weights):  # a folder's model is named after the folder
        check_hf_model_is_preset(weights, base["model"], cfg.model.name)  # no error: the preset's name it is
        return
    source = f"--resume continues the {saved_name} run in {run_dir}" if resumed else \
        f"init_from {weights} holds a {saved_name} model"
    raise ShardError(f"{source}; model {cfg.model.name} can't be loaded from it (leave out --model)")


def absolute_paths(cfg: config_mod.TrainConfig) -> config_mod.TrainConfig:
    """The config with data.path and eval.path (once checked to exist), a mesh file, init_from and
    checkpoint.local_dir made absolute: the saved config then names the same files wherever a resume
    starts from (a relative one read another folder's, or none). init_from is read only when the run has
    no checkpoint yet, so it is not checked here."""
    from shard.data.sources import EMBEDDED, SYNTHETIC, is_glob

    def absolute(path: str, key: str) -> str:
        if path in ("", EMBEDDED, SYNTHETIC):
            return path
        if is_glob(path) and not Path(path).exists():  # a glob: one source of its matches
            if not globmod.glob(path, recursive=True):
                raise ShardError(f"{key} {path} matches no file")
            return str(Path(path).absolute())
        if not Path(path).exists():
            raise ShardError(f"{key} {path} does not exist")
        return str(Path(path).absolute())

    tokenizer = cfg.data.tokenizer if cfg.data.tokenizer in ("", "byte") else absolute(cfg.data.tokenizer,
                                                                                         "data.tokenizer")
    data = dataclasses.replace(cfg.data, path=absolute(cfg.data.path, "data path"), tokenizer=tokenizer)
    # unused without eval.every, so not required to exist; but a later --eval-every must find the same files
    unused_and_missing = not cfg.eval.every and not Path(cfg.eval.path or ".").exists()
    evaluation = cfg.eval if unused_and_missing else dataclasses.replace(cfg.eval,
                                                                         path=absolute(cfg.eval.path, "eval.path"))
    init_from = str(Path(cfg.init_from).absolute()) if cfg.init_from else ""
    snapshots = cfg.checkpoint.local_dir
    if snapshots != "auto":  # a restart from another folder finds the same snapshots
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                      local_dir=str(Path(snapshots).absolute())))
    mesh_file, _ = split_mesh_file(cfg.mesh.spec) or ("", "")
    if mesh_file and Path(mesh_file).is_file():
        spec = rename_mesh_file(cfg.mesh.spec, lambda path: str(path.absolute()))
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, spec=spec))
    return dataclasses.replace(cfg, data=data, eval=evaluation, init_from=init_from)


def run_dir_for(cfg: config_mod.TrainConfig, mesh_spec: MeshSpec, resume: bool, main: bool) -> Path:
    """Where the run writes. Process 0 chooses (a default name has a time stamp) and tells the others
    once JAX runs; until then they only need its parent, for the compile cache."""
    path = choose_run_dir(cfg, mesh_spec, resume) if main else Path(cfg.run_dir or "runs/pending")
    globless(path.absolute() / CHECKPOINTS_DIR)  # before anything is written, the compile cache included
    return path


class RunDirClaim:
    """Process 0's hold on a run dir, so that one `shard train` writes it at a time: a run dir that
    exists is locked from the start (`hold`), a new one once made (`claim`), until `release`. What a
    first start writes (`write_start`) is forgotten again if it fails before its first step is logged
    or saved (`forget_unstarted`), and what was there before it is kept. The other processes hold
    nothing and write nothing here."""

    def __init__(self, path: Path, main: bool):
        self.path, self.main = path, main
        self.lock = RunDirLock(path)
        self.existed = path.is_dir()
        self.made = [p for p in (path.absolute(), *path.absolute().parents) if not p.exists()]  # deepest first
        self.found: set[str] = set()  # of the files a start writes, those that were there before it

    def hold(self) -> None:
        if self.main and self.existed:
            self.lock.acquire()

    def release(self) -> None:
        """Unlock; a run dir this start made and left empty (it failed before writing, on a full disk)
        goes, with the folders made for it."""
        self.lock.release()
        if self.main:
            remove_made_folders(self.made)

    def claim(self) -> None:
        """Make the run dir and lock it, unless another shard train started a run in it while this one
        prepared."""
        if not self.main:
            return
        self.found = {name for name in start_files() if (self.path / name).exists()}  # never removed
        self.path.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        if not self.existed and holds_run(self.path):  # another train made it (and may have ended) meanwhile
            raise ShardError(f"run dir {self.path} was started by another shard train while this one "
                             "prepared; run the command again (with --resume to continue that run)")

    def write_start(self, config_toml: str, init_from: str = "", first_start: bool = True) -> None:
        """Write the run's config.toml; on a first start from `init_from`, also the files export-hf
        writes back beside the weights (tokenizer, token ids), unless the run dir holds them already."""
        if not self.main:
            return
        from shard.run import hf_side

        if init_from and first_start and not {"config.toml", hf_side.SIDE_DIR} & self.found:
            hf_side.keep_side_files(init_from, self.path)
        write_text_atomic(self.path / "config.toml", config_toml)

    def forget_unstarted(self) -> None:
        """After a first start failed, remove what it wrote (shard.run.run_dir.forget_unstarted_run)."""
        if self.main:
            forget_unstarted_run(self.path, self.found)
