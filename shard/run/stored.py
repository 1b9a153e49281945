"""A checkpoint's model as it is stored, for what reads the weights alone (generate, eval, --init-from,
export): the step found and its meta checked, its arrays read onto the host or straight into shardings,
each checked against the checksums saved with it, and the params written out as a plain orbax checkpoint.
The train state's saves and restores are shard.run.checkpoint's.
"""

import functools
import math
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from shard.errors import ShardError
from shard.paths import check_fresh_out, globless, remove_made_folders
from shard.run.checkpoint_files import META, STATE, TMP_MARK, find_checkpoint, saved_meta
from shard.run.checkpoint_manager import orbax_manager, stored_tree
from shard.run.checksums import first_mismatch, host_fingerprint, state_fingerprint
from shard.run.hf import LazyParam
from shard.run.read_failures import error_line
from shard.run.step_meta import meta_problem
from shard.sharding.rules import path_str


def read_params(checkpoint: Path | str) -> tuple[dict, str, int]:
    """(params as numpy arrays, the resolved config TOML it was saved with, step) of a checkpoint (run
    dir, checkpoints dir or step dir), read on the host so no device needs to hold the model."""
    read, config, step = read_model_state(checkpoint, router_bias=False)
    return read["params"], config, step


def read_model_state(checkpoint: Path | str, router_bias: bool = True) -> tuple[dict, str, int]:
    """As `read_params`, with the state read as {"params", and "router_bias" where the checkpoint saved
    the MoE balancing bias its experts were chosen by (and `router_bias` asks for it)}: what evaluation and
    generation need of a checkpoint, without the optimizer state."""
    stored = StoredModel(checkpoint)
    keys = ("params", "router_bias") if router_bias else ("params",)
    return stored.read({k: stored.tree[k] for k in keys if k in stored.tree}), stored.config, stored.step


class StoredModel:
    """A checkpoint's model as it is stored: its meta checked (a config, no damage it shows) and its
    arrays' metadata read, nothing more; `read` reads arrays onto the host, `place` straight into
    shardings. Both compare what they read with the checksums saved with it."""

    def __init__(self, checkpoint: Path | str):
        directory, self.step = find_checkpoint(checkpoint)
        self.where, self.state_dir = directory / str(self.step), directory / str(self.step) / STATE
        self.meta = saved_meta(self.where)
        config = self.meta.get("config")
        if not isinstance(config, str):
            raise ShardError(f"cannot read checkpoint {self.where}: its {META}/ holds no readable config")
        self.config = config
        if problem := meta_problem(self.meta, self.step):
            raise ShardError(f"checkpoint {self.where} is damaged: {problem}; give an older step's dir")
        manager = orbax_manager(globless(directory), read_only=True)
        try:
            stored = stored_tree(manager, self.step)
        except Exception as e:  # noqa: BLE001 -- any failure to read is reported as one line
            raise ShardError(f"cannot read checkpoint {self.state_dir}: {error_line(e)}") from None
        finally:
            manager.close()
        self.tree = {k: stored[k] for k in ("params", "router_bias") if k in stored}  # metadata: shape, dtype

    def read(self, tree: dict) -> dict:
        """The arrays of `tree` (a part of `self.tree`, by the same paths) as numpy, checked."""
        item = jax.tree.map(lambda m: np.zeros((), m.dtype), tree)
        restore_args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        restored = self._restore(item, restore_args)
        self._check({path_str(p): [host_fingerprint(x), str(x.dtype)]
                     for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]})
        return restored

    def lazy_params(self) -> dict:
        """The params as StoredParams: read when asked (np.asarray, leaf by leaf) or placed (`place`)."""
        return jax.tree_util.tree_map_with_path(lambda p, m: StoredParam(self, p, m), self.tree["params"])

    def place(self, params: dict, shardings: dict, dtypes: dict) -> dict:
        """`params` (a tree of this checkpoint's StoredParams, a part of its params) read straight into
        `shardings`, each device reading its own shard (no copy of the model on the host), checked, then
        cast to `dtypes` where the run holds another."""
        item = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)
        restore_args = jax.tree.map(lambda x, s: ocp.ArrayRestoreArgs(sharding=s, global_shape=x.shape,
                                                                      dtype=x.dtype), params, shardings)
        # one stored leaf read at a time (a leaf saved on one device is one chunk, decoded whole): orbax's
        # default reads every leaf at once, a second copy of the model in read buffers
        largest = max(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(item))
        placed = self._restore({"params": item}, {"params": restore_args}, concurrent_gb=max(0.25, 1.01 * largest / 1e9))
        self._check(state_fingerprint(placed))
        return jax.tree.map(lambda x, d: x if x.dtype == d else x.astype(d), placed["params"], dtypes)

    def _restore(self, item: dict, restore_args: dict, concurrent_gb: float | None = None) -> dict:
        limit = {} if concurrent_gb is None else {"restore_concurrent_gb": concurrent_gb}
        try:
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**limit)) as reader:
                return reader.restore(self.state_dir, args=ocp.args.PyTreeRestore(
                    item=item, restore_args=restore_args, partial_restore=True))
        except Exception as e:  # noqa: BLE001 -- any failure to read is reported as one line
            raise ShardError(f"cannot read checkpoint {self.state_dir}: {error_line(e)}") from None

    def _check(self, read: dict) -> None:
        saved = self.meta.get("fingerprint")
        if isinstance(saved, dict) and (bad := first_mismatch(saved, read)):  # none: saved before fingerprints
            raise ShardError(f"checkpoint {self.where} is damaged: {bad} reads back other than it was saved "
                             "(checksum mismatch); give an older step's dir")


class StoredParam(LazyParam):
    """One param of a shard checkpoint, unread: np.asarray reads it onto the host (checked);
    shard.run.weights.place reads a tree of them straight into their shardings (StoredModel.place)."""

    def __init__(self, source: StoredModel, path: tuple, metadata):
        self.source, self.path = source, path
        super().__init__(metadata.shape, metadata.dtype, self._read_whole)

    def _read_whole(self, index: tuple) -> np.ndarray:
        tree = functools.reduce(lambda t, k: t[k.key], self.path, self.source.tree["params"])
        for k in reversed(self.path):  # this param alone, at its path
            tree = {k.key: tree}
        read = self.source.read({"params": tree})["params"]
        return functools.reduce(lambda t, k: t[k.key], self.path, read)[index]


def export_params(checkpoint: Path | str, out: Path | str) -> tuple[Path, int]:
    """Write the params of a checkpoint (run dir, checkpoints dir or step dir) as a plain orbax
    checkpoint at `out`, read on the host (numpy) so no device needs to hold the model."""
    out = globless(Path(out).absolute())
    check_fresh_out(out)
    made = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    out.mkdir(parents=True, exist_ok=True)  # a file in the way, no permission: here, not in orbax's thread
    out.rmdir()  # orbax makes it, from a temporary folder
    try:
        params, _, step = read_params(checkpoint)
        with ocp.StandardCheckpointer() as saver:
            saver.save(out, params)
            saver.wait_until_finished()
    except BaseException:  # a bad checkpoint, a full disk: nothing of the export left behind
        for partial in out.parent.glob(f"{out.name}{TMP_MARK}*"):
            shutil.rmtree(partial, ignore_errors=True)
        remove_made_folders(made[1:])  # the folders made for it
        raise
    return out, step
