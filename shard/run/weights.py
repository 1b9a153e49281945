"""Model weights from outside the run: a shard checkpoint (run dir, checkpoints dir or step dir) or a
Hugging Face Llama folder, read on the host, then placed into a mesh's shardings. Serves
`shard generate`, `shard eval`, `shard train --init-from`, `shard import-hf` and `shard export-hf`."""

from pathlib import Path

import jax
import numpy as np

from shard.config.resolve import resolve
from shard import tomlfiles
from shard.config.train import TrainConfig
from shard.errors import ShardError
from shard.run.hf import is_hf_dir
from shard.config.model import ModelConfig
from shard.training.state import StateSpec, placed_router_bias


def load(path: str | Path) -> tuple[ModelConfig, dict]:
    """(model config, params as numpy) from a shard checkpoint or a Hugging Face folder."""
    return _load(path, router_bias=False)[:2]


def load_with_router_bias(path: str | Path) -> tuple[ModelConfig, dict, np.ndarray | None]:
    """As `load`, and the MoE balancing bias (L, E) the checkpoint's experts were chosen by
    (model.router_bias_update), for evaluation and generation to choose as training did; None for a
    Hugging Face folder and a checkpoint saved without one."""
    return _load(path, router_bias=True)


def _load(path: str | Path, router_bias: bool) -> tuple[ModelConfig, dict, np.ndarray | None]:
    from shard.run import hf

    if not Path(path).exists():
        raise ShardError(f"weights path {path} does not exist")
    if is_hf_dir(path):
        hf_config, tensors = hf.read_hf_dir(str(path))
        cfg = hf.config_from_hf(hf_config, name=Path(path).name or "hf")
        # read tensor by tensor as `place` puts them on the devices: never the whole model twice on the host
        return cfg, hf.lazy_params_from_hf(tensors, cfg), None
    if (Path(path) / "config.json").exists():
        raise ShardError(f"{Path(path) / 'config.json'} is not a file")
    from shard.run.checkpoint import read_model_state

    read, config_toml, _ = read_model_state(path, router_bias=router_bias)
    # only the model is read: the run's other settings (ranges checked by newer versions) don't matter here
    saved = tomlfiles.parse(config_toml, f"the config saved with checkpoint {path}")
    if not isinstance(saved.get("model"), dict):  # the defaults would build another model than the weights'
        raise ShardError(f"checkpoint {path} holds no model config (it was saved without one: pass "
                         "config_toml=shard.config.to_toml(cfg) to Checkpoints.save)")
    cfg = resolve({"model": saved["model"]}).model
    # a checkpoint saved before the tables were padded (shard.config.model.VOCAB_MULTIPLE) holds vocab_size rows
    return cfg, hf.pad_vocab(read["params"], cfg), read.get("router_bias")


def saved_run_config(path: str | Path) -> TrainConfig | None:
    """The whole config a shard checkpoint was saved with (its data, batch, held-out share, ...), read
    without JAX; None for a Hugging Face folder, which has none."""
    if is_hf_dir(path):
        return None
    from shard.run.checkpoint import find_checkpoint, saved_config

    directory, step = find_checkpoint(path)
    text = saved_config(directory / str(step))
    if text is None:
        raise ShardError(f"checkpoint {directory / str(step)} holds no readable config")
    return resolve(tomlfiles.parse(text, f"the config saved with checkpoint {directory / str(step)}"))


def held_out_since(path: str | Path) -> int | None:
    """The step since which a shard checkpoint's run has held its evaluation data out of training (0:
    from the start); None for a Hugging Face folder or a checkpoint that does not record it."""
    if is_hf_dir(path):
        return None
    from shard.run.checkpoint import find_checkpoint, saved_meta

    directory, step = find_checkpoint(path)
    since = saved_meta(directory / str(step)).get("held_out_since")
    return since if isinstance(since, int) and not isinstance(since, bool) and since >= 0 else None


def place(params: dict, spec: StateSpec) -> dict:
    """Host params into the spec's parameter shardings, after checking every shape against the model.
    Params read lazily (a Hugging Face folder's, shard.run.hf.LazyParam) are placed one at a time, each
    device reading only its own shard of the HF tensors: the host holds the placed shards and one tensor
    being read, not a second copy of the model."""
    from shard.run.hf import LazyParam

    spec.check_params_fit(params, "the weights")

    def put(x, a, sharding):
        if not isinstance(x, LazyParam):
            return jax.device_put(np.asarray(x, a.dtype), sharding)
        placed = jax.make_array_from_callback(a.shape, sharding, lambda index: np.asarray(x.read(index), a.dtype))
        x.forget()
        return placed

    return jax.tree.map(put, params, spec.abstract["params"], spec.shardings["params"],
                        is_leaf=lambda x: isinstance(x, LazyParam))


def state_from(params: dict, spec: StateSpec, seed: int, source: str):
    """A fresh train state (step 0, new optimizer state) around loaded params, for `--init-from`:
    returned as a shard.run.checkpoint.Restored so `prepare(restore=...)` takes it like a checkpoint."""
    import jax.numpy as jnp

    from shard.run.checkpoint import Restored

    placed = place(params, spec)
    opt_state = jax.jit(spec.tx.init, out_shardings=spec.shardings["opt_state"])(placed)
    step = jax.device_put(jnp.zeros((), jnp.int32), spec.shardings["step"])
    state = {"step": step, "params": placed, "opt_state": opt_state} | placed_router_bias(spec)
    return Restored(step=0, state=state, position=0,
                    seed=seed, config_toml="", path=Path(source))
