"""Checkpoints of the train state with orbax: asynchronous, sharded, atomic, restorable onto any mesh.

Layout: `RUN_DIR/checkpoints/<step>/state` is the train-state pytree ({"step", "params", "opt_state"}, and
"router_bias" where MoE balancing uses one)
written by orbax's StandardCheckpointHandler, each process writing the shards it holds;
`RUN_DIR/checkpoints/<step>/meta` is JSON: the data position (a global sample index), the seed, the
resolved config, a checksum per array (state_fingerprint) and the tokens trained on. A LoRA run's params
are its adapters alone: the base weights are its config's init_from (or its seed's init), and their
checksums are kept in meta, so a restore reads them from there and checks them. orbax writes a step into
`<step>.orbax-checkpoint-tmp` and renames it once every process has finished, so a directory named by
a bare step number is complete and anything else is a save that never finished. Restore reads each
array straight into the shardings of the mesh at hand.
"""

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from shard.cluster import exchange, runtime
from shard.config.train import CheckpointConfig, is_harness_metric
from shard.errors import ShardError
from shard.paths import globless
from shard.run.checkpoint_files import (CORRUPT_PREFIX, LORA_BASE_FINGERPRINT, META, STATE, TMP_MARK,  # noqa: F401
                                        Restored, config_saved_with, find_checkpoint, saved_config, saved_meta,
                                        step_dirs)
from shard.run.checkpoint_manager import orbax_manager, stored_tree
from shard.run.checksums import first_mismatch, state_fingerprint
from shard.run.read_failures import BAD, MACHINE, read_outcomes
from shard.run.step_meta import meta_problem
from shard.training.lora import has_adapters, merge, split
from shard.training.state import StateSpec, placed_fp8_histories, placed_router_bias
from shard.training.observer import Observer



class Checkpoints:
    """One run's checkpoint directory: async saves, retention (newest K, optionally best by a metric),
    and restore of the newest readable complete checkpoint into any mesh."""

    def __init__(self, directory: Path | str, cfg: CheckpointConfig | None = None,
                 notice: Callable[[str], None] | None = None, read_only: bool = False,
                 write_concurrent_gb: float | None = None, label: str = "checkpoint",
                 barrier_prefix: str | None = None):
        """`write_concurrent_gb`: the most bytes (GB) orbax writes at once; None its default (96), which
        buffers a whole model's chunks at once (import-hf bounds it: a second copy of what it imports).
        `label` names a step in notices; `barrier_prefix` keeps the barriers of a second folder's saves
        (local snapshots, shard.run.snapshots) apart from this one's."""
        self.directory = globless(Path(directory).absolute())
        if not read_only and self.directory.is_dir() and not os.access(self.directory, os.W_OK):
            # before any step runs: a save would fail only after the steps since the last checkpoint
            raise ShardError(f"checkpoint folder {self.directory} is not writable (a read-only mount, or no "
                             "permission); its checkpoints can still be read with shard generate or export")
        self.cfg = cfg or CheckpointConfig()
        self.notice = notice or (lambda message: None)
        self.label = label
        self._manager = orbax_manager(self.directory, self.cfg, read_only, write_concurrent_gb, barrier_prefix)

    # -- what is on disk --------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def incomplete(self) -> list[Path]:
        """Step directories a save began and never committed (killed, power loss)."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if TMP_MARK in p.name)

    def clean_incomplete(self) -> None:
        """Remove unfinished saves, one notice line each; complete checkpoints are never touched."""
        for p in self.incomplete():
            self.notice(f"removing incomplete {self.label} {p.name} (a save that never finished)")
            if runtime.context().is_main:
                shutil.rmtree(p, ignore_errors=True)
        self._sync("clean_incomplete")

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def reload(self) -> None:
        """Read the steps on disk again, after the folder was changed by hand (removed)."""
        self._manager.reload()

    def delete(self, step: int) -> None:
        """Remove complete step `step` (every process calls it; orbax's primary process deletes)."""
        self._manager.delete(step)

    # -- save -------------------------------------------------------------------------------------

    def save(self, step: int, state: dict, *, position: int, seed: int, config_toml: str,
             metrics: dict | None = None, tokens_seen: int | None = None, held_out_since: int | None = None) -> None:
        """Start an async save of `state` at `step`; returns once the arrays are copied off the devices,
        so the caller may donate them to the next step."""
        if not runtime.writes_shared_files():
            return  # the MPI bridge: process 0 writes the replica every process holds
        meta = {"step": step, "data_position": int(position), "seed": seed, "config": config_toml}
        if has_adapters(state.get("params")):  # LoRA: the adapters, and the base's checksums to check it by
            adapters, base = split(state["params"])
            meta[LORA_BASE_FINGERPRINT] = state_fingerprint(base)
            state = state | {"params": adapters}
        meta["fingerprint"] = state_fingerprint(state)
        if tokens_seen is not None:
            meta["tokens_seen"] = int(tokens_seen)
        if held_out_since is not None:
            meta["held_out_since"] = int(held_out_since)
        if runtime.context().is_main and ((p := self.path(step)).is_symlink() or p.exists() and not p.is_dir()):
            # not a step orbax wrote: its save would replace it in silence
            self.notice(f"{p} is a file, not a checkpoint step folder; set aside as {self._move_aside(step).name}")
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)})
        self._manager.save(step, args=args, metrics=metrics, force=True)

    def wait(self) -> None:
        """Block until every started save is committed (renamed into place)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    # -- restore ----------------------------------------------------------------------------------

    def stored_tree(self, step: int) -> dict:
        """The saved state's tree of orbax ArrayMetadata (shape, dtype, sharding), read from the files."""
        return stored_tree(self._manager, step)

    def restore(self, step: int, spec: StateSpec) -> Restored:
        """Read checkpoint `step` directly into `spec`'s shardings (any mesh, any process count)."""
        return self._checked(step, self._read(step, spec), spec)

    def _read(self, step: int, spec: StateSpec) -> dict:
        """orbax's restore of the state and meta items, which ends in a barrier of every process."""
        stored = self.stored_tree(step)
        if has_adapters(stored["params"]) != (spec.lora is not None):
            raise ShardError(f"checkpoint {self.path(step)} holds LoRA adapters, not a whole model: resume it with its "
                             "[lora] settings" if spec.lora is None else f"checkpoint {self.path(step)} holds a whole "
                             f"model, not LoRA adapters: start LoRA from it with --init-from in a new run dir")
        spec.check_params_fit(stored["params"], f"checkpoint {self.path(step)}", "; it was saved from a different model"
                              + (" or without LoRA (lora.rank)" if spec.lora else ""), part="adapters")
        if "opt_state" not in stored:  # import-hf's: the weights alone
            raise ShardError(f"checkpoint {self.path(step)} holds weights only (no optimizer state: import-hf writes "
                             "them so); train from them with --init-from in a new run dir")
        spec.check_opt_state_fits(stored["opt_state"], f"checkpoint {self.path(step)}")  # not set aside: a caller's error
        target = spec.abstract_with_shardings()
        target["params"] = spec.trainable(target["params"])  # LoRA: the adapters
        # the MoE router bias (model.router_bias_update): a checkpoint saved without it starts it at
        # zero; one saved with it, restored where balancing is off, leaves it out
        fresh_bias = "router_bias" in target and "router_bias" not in stored
        if fresh_bias:
            del target["router_bias"]
        elif "router_bias" in stored and "router_bias" not in target:
            bias = stored["router_bias"]
            target["router_bias"] = jax.ShapeDtypeStruct(bias.shape, bias.dtype, sharding=spec.shardings["step"])
        _fp8_as_saved(stored, target, spec)
        args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target), META: ocp.args.JsonRestore()})
        out = self._manager.restore(step, args=args)
        if fresh_bias:
            out[STATE]["router_bias"] = placed_router_bias(spec)["router_bias"]
        elif "router_bias" not in spec.abstract:
            out[STATE].pop("router_bias", None)
        return out

    def _checked(self, step: int, out: dict, spec: StateSpec) -> Restored:
        """What was read, checked: a data position, and each array's checksum against the saved one;
        a LoRA run's adapters joined by their base weights."""
        meta = out[META]
        if problem := meta_problem(meta, step):  # read as unreadable: restore_latest sets it aside
            raise ValueError(problem)
        if (at := int(np.asarray(out[STATE]["step"].addressable_data(0)))) != step:
            raise ValueError(f"its state is at step {at}, but the folder is named {step} (renamed?)")
        saved = meta.get("fingerprint")  # checkpoints written before fingerprints have none
        if isinstance(saved, dict) and (bad := first_mismatch(saved, state_fingerprint(out[STATE]))):
            raise ValueError(f"{bad} reads back other than it was saved (checksum mismatch)")
        _fit_fp8(out[STATE], spec)
        if spec.lora is not None:
            out[STATE]["params"] = merge(out[STATE]["params"], self._lora_base(step, meta, spec))
        tokens, since = meta.get("tokens_seen"), meta.get("held_out_since")
        return Restored(step=step, state=out[STATE], position=int(meta["data_position"]), seed=int(meta["seed"]),
                        config_toml=meta["config"], path=self.path(step),
                        tokens_seen=None if tokens is None else int(tokens),
                        held_out_since=None if since is None else int(since))

    def _lora_base(self, step: int, meta: dict, spec: StateSpec) -> dict:
        """The base weights of a LoRA checkpoint in the spec's shardings, checked against its checksums."""
        from shard import tomlfiles
        from shard.run.weights import check_lora_base, placed_base

        saved = tomlfiles.parse(meta["config"], f"the config saved with checkpoint {self.path(step)}")
        base = placed_base(saved, spec, str(self.path(step)))
        check_lora_base(meta.get(LORA_BASE_FINGERPRINT), state_fingerprint(base), self.path(step), saved)
        return base

    def restore_latest(self, spec: StateSpec) -> Restored:
        """The newest complete checkpoint that reads back; unreadable ones are set aside (renamed to
        corrupt-<step>, with a notice) and the previous one is tried."""
        self.clean_incomplete()
        steps = self.steps()
        if not steps:
            raise ShardError(f"no complete checkpoint in {self.directory}")
        for i in range(len(steps) - 1, -1, -1):
            step = steps[i]
            restored, outcomes, error = self.read_agreed(step, spec)
            if not any(outcomes):
                return restored
            where = "" if len(outcomes) == 1 else " on process {rank}"
            machine = [(r, o) for r, o in enumerate(outcomes) if o.startswith(MACHINE)]
            if machine:  # not this checkpoint's fault: it stays where it is
                rank, outcome = machine[0]
                raise ShardError(f"cannot read checkpoint {self.path(step)}{where.format(rank=rank)} "
                                 f"({outcome.removeprefix(MACHINE)}); it is left in place") from error
            rank, outcome = next((r, o) for r, o in enumerate(outcomes) if o.startswith(BAD))
            fallback = f"falling back to step {steps[i - 1]}" if i else "no older checkpoint is left"
            self.notice(f"checkpoint {self.path(step)} is unreadable{where.format(rank=rank)} "
                        f"({outcome.removeprefix(BAD)}); set aside as {CORRUPT_PREFIX}{step}, {fallback}")
            self._set_aside(step)
        raise ShardError(f"no readable checkpoint in {self.directory} (unreadable ones were renamed "
                         f"{CORRUPT_PREFIX}<step>); --resume --allow-fresh starts this run again from step 0")

    def read_agreed(self, step: int, spec: StateSpec) -> tuple[Restored | None, list[str], Exception | None]:
        """Read and check `step` on every process: (what this process read, every process's outcome
        (shard.run.read_failures.read_outcomes: all "" when each read its part), this process's error)."""
        error, reading, restored = None, True, None
        try:
            out = self._read(step, spec)
            reading = False  # past orbax's closing barrier: the checks fail alike on every process
            restored = self._checked(step, out, spec)
        except ShardError:
            raise
        except Exception as e:  # noqa: BLE001 -- orbax/tensorstore raise ValueError, OSError, ...
            error = e
        return restored, read_outcomes(step, error, in_read=reading), error

    def _set_aside(self, step: int) -> None:
        if runtime.context().is_main:
            self._move_aside(step)
        self._sync(f"set_aside_{step}")
        self.reload()

    def _move_aside(self, step: int) -> Path:
        """Rename what stands at `step` to corrupt-<step> (corrupt-<step>.N when that is taken)."""
        target = self.directory / f"{CORRUPT_PREFIX}{step}"
        n = 1
        while target.exists() or target.is_symlink():
            target, n = self.directory / f"{CORRUPT_PREFIX}{step}.{n}", n + 1
        self.path(step).rename(target)
        return target

    @staticmethod
    def _sync(name: str) -> None:
        exchange.barrier(f"checkpoint_{name}", device_collective=True)


def _fp8_as_saved(stored: dict, target: dict, spec: StateSpec) -> None:
    """fp8_delayed's amax histories in the restore target as the checkpoint holds them (or none), so they
    are read and checked against their checksums whatever this run keeps (`_fit_fp8` then fits them)."""
    if "fp8" in stored:
        target["fp8"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=spec.shardings["step"]),
                                     stored["fp8"])
    else:
        target.pop("fp8", None)


def _fit_fp8(state: dict, spec: StateSpec) -> None:
    """The restored amax histories fitted to this run: left out where it keeps none, empty where the
    checkpoint holds none or another precision's (other fp8_delayed weights)."""
    if "fp8" not in spec.abstract:
        state.pop("fp8", None)
        return
    read, want = state.get("fp8"), spec.abstract["fp8"]
    same = read is not None and jax.tree.structure(read) == jax.tree.structure(want) and all(
        a.shape == b.shape for a, b in zip(jax.tree.leaves(read), jax.tree.leaves(want)))
    if not same:
        state["fp8"] = placed_fp8_histories(spec)


class SaveCheckpoints(Observer):
    """Loop observer: saves every `cfg.every` steps, at the last step and when the loop stops early
    (preemption), then waits for the saves to commit when the loop ends. A save is ranked by the
    step's metric, or by the evaluation logged at that step (a stop between evaluations has none)."""

    def __init__(self, checkpoints: Checkpoints, *, seed: int, config_toml: str):
        self.checkpoints, self.seed, self.config_toml = checkpoints, seed, config_toml
        self.every, self.best_metric = checkpoints.cfg.every, checkpoints.cfg.best_metric
        self.last_saved: int | None = None
        self.run = None  # the loop's Run, for the tokens seen at a step
        # ranked by an evaluation's figure (the held-out loss, a benchmark score), not by every step's
        self.by_evaluation = self.best_metric == "eval_loss" or is_harness_metric(self.best_metric)
        self.evaluated: tuple[int, float] | None = None  # (step, that figure) of the last evaluation logged

    def on_start(self, run) -> None:
        self.run = run

    def on_log(self, record: dict) -> None:
        if self.by_evaluation and self.best_metric in record:
            self.evaluated = record["step"], record[self.best_metric]

    def saves_at(self, step: int, final: bool) -> bool:
        """The loop checks every step up to a save for divergence first, so only good states are saved."""
        return bool(final or (self.every and step % self.every == 0))

    def on_state(self, step: int, state: dict, position: int, metrics: dict, final: bool) -> None:
        if not self.saves_at(step, final):
            return
        ranked = None
        if self.by_evaluation:  # {} (ranked last) between evaluations: None would be kept forever
            ranked = ({self.best_metric: self.evaluated[1]} if self.evaluated and self.evaluated[0] == step
                      else {})
        elif self.best_metric:
            ranked = {self.best_metric: float(jax.device_get(metrics[self.best_metric]))}
        tokens = self.run.tokens_seen(step) if self.run is not None else None
        since = self.run.held_out_since if self.run is not None else None
        self.checkpoints.save(step, state, position=position, seed=self.seed, config_toml=self.config_toml,
                              metrics=ranked, tokens_seen=tokens, held_out_since=since)
        self.last_saved = step

    def on_end(self, records: list[dict]) -> None:
        self.checkpoints.wait()


