"""Where a run's state comes from: the config a --resume or --init-from starts with, the checkpoint or
weights it restores, and what a resume changes that makes it inexact."""

import dataclasses
import tomllib
from collections.abc import Callable
from pathlib import Path

from shard.config.resolve import differences, load_file, resolve
from shard.config.train import TrainConfig
from shard import tomlfiles
from shard.errors import ShardError
from shard.paths import CHECKPOINTS_DIR
from shard.run.run_dir import config_on_record


def held_out_change(was: float, now: float) -> str:
    share = lambda f: f"the last {f:.0%} of the data" if f else "none of the data"  # noqa: E731
    return (f"evaluation held out {share(was)} from training and now holds out {share(now)} (eval.every, "
            "eval.path): training reads a different set of windows from here on, so this is not an exact resume")


# Config keys a resume may change, though the run then no longer continues exactly as it would have,
# and why. The learning-rate schedule is warmup, then cosine decay over `steps` (shard.training.state); the
# saved data position counts samples of the data order that the seed, the data and the windows make.
INEXACT_CHANGES = (
    (("steps", "optimizer.lr", "optimizer.warmup_steps", "optimizer.min_lr_ratio"),
     "the learning-rate schedule changes ({what}): from the resumed step on the learning rate follows the new one"),
    (("seed", "data.path", "data.seq_len"),
     "the data order changes ({what}): the saved data position counts samples of the old order: training "
     "reads other samples from here on"),
    (("data.batch",), "the batch changes ({what}): the samples after the saved position come in other batches"),
    (("model.param_dtype",), "the parameter dtype changes ({what}): the saved state is cast to it"),
    (("model.rope_theta", "model.rope_scaling", "model.rope_low_freq_factor", "model.rope_high_freq_factor",
      "model.rope_original_context", "model.rope_scaling_type", "model.rope_beta_fast", "model.rope_beta_slow",
      "model.rope_mscale", "model.rope_mscale_all_dim", "model.rope_attention_factor", "model.rope_truncate",
      "model.norm_eps", "model.compute_dtype", "model.experts_per_token",
      "model.capacity_factor", "model.aux_loss_weight", "model.router_z_loss_weight",
      "model.router_bias_update", "model.router_groups", "model.router_topk_groups", "model.mtp_loss_weight"),
     "the model changes ({what}): the restored weights compute something else from here on"),
    (("optimizer.b1", "optimizer.b2", "optimizer.eps", "optimizer.weight_decay", "optimizer.grad_clip"),
     "the optimizer changes ({what}): the restored moments are updated by the new rule from here on"),
)


def inexact_changes(saved: TrainConfig, cfg: TrainConfig) -> list[str]:
    """A notice for each kind of change in `INEXACT_CHANGES` that a resume makes to the saved config."""
    diffs = differences(saved, cfg)
    notes = []
    for keys, reason in INEXACT_CHANGES:
        shown = lambda v: '""' if v == "" else v  # noqa: E731 -- the embedded corpus's empty data.path
        changed = [f"{k} {shown(a)} -> {shown(b)}" for k, a, b in diffs if k in keys]
        if changed:
            notes.append(reason.format(what=", ".join(changed)) + ", so this is not an exact resume")
    return notes


def ranking_change(saved: TrainConfig, cfg: TrainConfig) -> list[str]:
    """A notice when a resume changes how checkpoints are ranked: each save recorded only the metric it
    was ranked by (shard.run.checkpoint), so the earlier saves may lose their place among the best."""
    changed = [f"{k} {a or '(none)'} -> {b or '(none)'}" for k, a, b in differences(saved, cfg)
               if k in ("checkpoint.best_metric", "checkpoint.best_mode")]
    was, metric, keep = saved.checkpoint.best_metric, cfg.checkpoint.best_metric, cfg.checkpoint.keep
    if not changed or not (was or metric):
        return []
    if not metric:
        fate = f"the best checkpoints saved so far are kept only while among the newest {keep}"
    elif not was:
        fate = "the checkpoints saved so far recorded no ranking, and unranked checkpoints are all kept"
    elif metric != was:
        fate = (f"the checkpoints saved so far recorded no {metric}: they rank last, so once "
                f"{cfg.checkpoint.keep_best} save(s) are ranked by it they are kept only while among the newest {keep}")
    else:
        fate = (f"the checkpoints saved so far are ranked again: the {'lowest' if cfg.checkpoint.best_mode == 'min' else 'highest'} "
                f"{metric} is the best")
    return [f"the checkpoint ranking changes ({', '.join(changed)}): {fate}"]


def resume_changes(base: dict, cfg: TrainConfig) -> list[str]:
    """Notes on what a resume changes: what makes it inexact (the held-out share, the lr schedule, ...),
    and a new checkpoint ranking."""
    from shard.data.sources import EMBEDDED, SYNTHETIC
    from shard.data.batches import held_out_share

    saved = resolve(base)
    if saved.data.path not in (EMBEDDED, SYNTHETIC) and Path(saved.data.path).absolute() == Path(cfg.data.path):
        # a config saved before data paths were saved absolute: the same files, read from the same folder
        saved = dataclasses.replace(saved, data=dataclasses.replace(saved.data, path=cfg.data.path))
    # a config saved before eval.holdout existed trained on every window
    was = held_out_share(saved) if "holdout" in base.get("eval", {}) else 0.0
    now = held_out_share(cfg)
    notes = [held_out_change(was, now)] if was != now else []
    return notes + inexact_changes(saved, cfg) + ranking_change(saved, cfg)


def restore_source(checkpoints, resume: bool, allow_fresh: bool, init_from: str, seed: int,
                   notice: Callable[[str], None], snapshots=None) -> Callable | None:
    """What `prepare` restores the state with: with --resume the newest of the run's complete checkpoints
    and its local snapshot (`snapshots`, shard.run.snapshots), as a NewestState; else weights from
    elsewhere with a fresh optimizer (init_from), or None for a fresh init. A fresh start removes the
    snapshots an earlier run in the same run dir left (in /dev/shm they outlive its folder)."""
    if resume:
        checkpoints.clean_incomplete()
        if snapshots is not None:
            snapshots.clean_incomplete()
        snapshot = snapshots.newest_everywhere()[0] if snapshots is not None else None  # on every process
        if checkpoints.steps() or snapshot is not None:
            fresh = (lambda: _fresh_source(init_from, seed)) if allow_fresh else None
            return NewestState(checkpoints, snapshots, fresh, seed, notice)
        if not allow_fresh:
            raise ShardError(f"--resume: no complete checkpoint in {checkpoints.directory}; pass "
                             "--allow-fresh to start this run from step 0")
        notice(f"no checkpoint in {checkpoints.directory} yet: starting from step 0")
    elif snapshots is not None and snapshots.holds:
        notice(f"removing the local snapshots in {snapshots.folder}: an earlier run in this run dir left them, "
               "and this one starts from step 0")
        snapshots.remove_all()
    return _fresh_source(init_from, seed)


def _fresh_source(init_from: str, seed: int) -> Callable | None:
    """A fresh start's source: the weights of `init_from` with a fresh optimizer, or None (the init)."""
    if not init_from:
        return None
    from shard.run import weights
    from shard.run.inference import load_model

    loaded = load_model(init_from, inference=False)  # on the host: placed into the run's own layout
    return lambda spec: weights.state_from(loaded.host_params, spec, seed, init_from, loaded.host_router_bias)


class NewestState:
    """--resume's restore: the newest of the run's durable checkpoints and its local snapshot, each read
    and checked as restores are. A snapshot that does not read back whole on this mesh (its files are on
    a host that is gone, or damaged) is left where it is, never set aside as a corrupt checkpoint is: the
    restore falls back to the durable checkpoint, said in one line; with --allow-fresh and no durable
    checkpoint, to step 0 (`fresh`). After the call, `where` names what was read."""

    def __init__(self, checkpoints, snapshots, fresh: Callable[[], Callable | None] | None, seed: int,
                 notice: Callable[[str], None]):
        self.checkpoints, self.snapshots, self.fresh, self.seed, self.notice = (checkpoints, snapshots, fresh,
                                                                                seed, notice)
        self.where = ""

    def __call__(self, spec):
        durable = self.checkpoints.steps()
        step, problem = self.snapshots.newest_everywhere() if self.snapshots is not None else (None, None)
        if step is not None and (not durable or step > durable[-1]):
            restored, problem = (None, problem) if problem else self.snapshots.read(step, spec)
            if restored is not None:
                self.where = f"local snapshot {restored.path}"
                return restored
            unread = f"local snapshot at step {step} can't be read ({problem})"
            if not durable and self.fresh is None:
                raise ShardError(f"--resume: {unread}, and {self.checkpoints.directory} holds no checkpoint; "
                                 "--resume --allow-fresh starts this run again from step 0")
            self.notice(f"{unread}: " + (f"resuming from checkpoint {durable[-1]}" if durable else
                                         "starting from step 0"))
        if durable:
            restored = self.checkpoints.restore_latest(spec)
            self.where = str(restored.path)
            return restored
        return self._fresh(spec)

    def _fresh(self, spec):
        """Step 0: the init_from weights, or the init of the seed, as a Restored at step 0."""
        from shard.run.checkpoint_files import Restored
        from shard.training.state import init_state

        if self.fresh is None:  # the folders changed since restore_source looked
            raise ShardError(f"--resume: no complete checkpoint in {self.checkpoints.directory}; pass --allow-fresh "
                             "to start this run from step 0")
        source = self.fresh()
        if source is not None:
            return source(spec)
        return Restored(step=0, state=init_state(spec, spec.model, self.seed), position=0, seed=self.seed,
                        config_toml="", path=self.checkpoints.directory)


def init_from_base(source: str) -> dict:
    """The model section of the weights' own config (config.json, or the config the checkpoint step was
    saved with), read without JAX, so the run builds exactly that model."""

    from shard.run import hf
    from shard.run.checkpoint import find_checkpoint, saved_config
    from shard.run.hf_config import is_hf_dir, read_json

    path = Path(source)
    if not path.exists():
        raise ShardError(f"--init-from: {source} does not exist")
    if is_hf_dir(path):
        config_json = read_json(path / "config.json")
        # DeepSeek-V3's MTP modules are read where its tensors hold them: their names from the files' headers
        names = set(hf.read_hf_dir(str(path))[1]) if config_json.get("model_type") == "deepseek_v3" else ()
        cfg = hf.config_from_hf(config_json, name=path.name or "hf", tensor_names=names)
        return {"model": dataclasses.asdict(cfg)}
    directory, step = find_checkpoint(path)
    text = saved_config(directory / str(step))  # the step's own, as shard.run.weights reads it
    try:
        if text is not None:
            return {"model": tomllib.loads(text)["model"]}
    except (tomllib.TOMLDecodeError, KeyError):
        pass
    raise ShardError(f"--init-from: checkpoint {directory / str(step)} holds no readable config")


# What a Hugging Face config.json decides of a model (shard.run.hf.config_from_hf); the rest is how to run it.
HF_MODEL_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim",
                   "tie_embeddings", "rope_theta", "rope_scaling", "rope_low_freq_factor", "rope_high_freq_factor",
                   "rope_original_context", "rope_scaling_type", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
                   "rope_mscale_all_dim", "rope_attention_factor", "rope_truncate", "norm_eps", "qkv_bias", "qk_norm",
                   "n_experts", "sliding_window",
                   "global_every", "rope_local_theta", "query_scale", "attn_softcap", "final_softcap",
                   "norm_plus_one", "sandwich_norms", "embed_scale", "mlp_activation")


def check_hf_model_is_preset(source: str, hf_model: dict, name: str) -> None:
    """`--init-from HF_FOLDER --model NAME`: the folder's model (named after the folder) may be called
    by a preset's name where it is that preset's model; else a one-line error says how they differ."""
    from shard.config.presets import PRESETS

    if name not in PRESETS:
        raise ShardError(f"unknown model {name!r} (known: {', '.join(PRESETS)}); leave out --model to use the "
                         f"model of {source}")
    preset = dataclasses.asdict(PRESETS[name])
    for key in HF_MODEL_FIELDS:
        if hf_model[key] != preset[key]:
            raise ShardError(f"init_from {source} is another model than {name} (model.{key} is {hf_model[key]!r} "
                             f"there, {preset[key]!r} in {name}); leave out --model to use its own")


def resume_base(run_dir: str | None, allow_fresh: bool = False,
                notice: Callable[[str], None] | None = None) -> dict:
    """The config a resumed run starts from: the one saved in its run dir (flags still override it).
    With --allow-fresh a run dir that doesn't exist yet is a first start. `notice` hears that the
    checkpoint's copy stands in for a lost config.toml."""
    if not run_dir:
        raise ShardError("--resume needs --run-dir: the run to continue")
    saved = Path(run_dir) / "config.toml"
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise ShardError(f"--resume: run dir {run_dir} is a file")
    if not Path(run_dir).is_dir() and not allow_fresh:
        raise ShardError(f"--resume: run dir {run_dir} does not exist (--allow-fresh starts it when it doesn't)")
    from shard.run.checkpoint import config_saved_with

    if config_on_record(Path(run_dir)):  # an empty one would resume with every default
        try:
            return load_file(str(saved))
        except ShardError as e:  # not read over: it may hold the user's edit; the way out is named
            found = config_saved_with(Path(run_dir) / CHECKPOINTS_DIR)
            raise ShardError(f"--resume: {e}" + (f"; fix it, or move it away to resume with the config saved "
                                                 f"with checkpoint {found[1]}" if found else "")) from None

    if found := config_saved_with(Path(run_dir) / CHECKPOINTS_DIR):  # config.toml lost: the checkpoint's copy
        text, step = found
        if notice:
            notice(f"{saved} {'is empty' if saved.is_file() else 'is missing'}: using the config saved with "
                   f"checkpoint {step}")
        return tomlfiles.parse(text, f"--resume: the config saved with checkpoint {step}")
    return {}
