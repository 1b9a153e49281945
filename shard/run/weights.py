"""Model weights from outside the run: a shard checkpoint (run dir, checkpoints dir or step dir) or a
Hugging Face Llama folder, read on the host, then placed into a mesh's shardings. Serves
`shard generate`, `shard eval`, `shard train --init-from`, `shard import-hf` and `shard export-hf`."""

import functools
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shard.config.resolve import resolve
from shard import tomlfiles
from shard.config.finetune import LoraConfig
from shard.config.train import TrainConfig
from shard.errors import ShardError
from shard.run.hf_config import is_hf_dir
from shard.sharding.rules import spec_entries
from shard.config.model import ModelConfig
from shard.training.state import StateSpec, placed_extras


def load(path: str | Path) -> tuple[ModelConfig, dict]:
    """(model config, params) from a shard checkpoint or a Hugging Face folder: numpy arrays, or params read
    when asked (shard.run.hf.LazyParam: np.asarray reads one; `place` puts them into their shardings)."""
    return _load(path, router_bias=False)[:2]


def load_with_router_bias(path: str | Path, inference: bool = True) -> tuple[ModelConfig, dict, np.ndarray | None]:
    """As `load`, with the MoE balancing bias (L, E) the checkpoint's experts were chosen by
    (model.router_bias_update; a Hugging Face folder's e_score_correction_bias), to choose as training
    did; None for a checkpoint saved without one. `inference`: the config as evaluation and generation
    run it (ModelConfig.for_inference on this backend)."""
    cfg, params, bias = _load(path, router_bias=True)
    return (cfg.for_inference(jax.default_backend()) if inference else cfg), params, bias


def _load(path: str | Path, router_bias: bool) -> tuple[ModelConfig, dict, np.ndarray | None]:
    from shard.run import hf

    if not Path(path).exists():
        raise ShardError(f"weights path {path} does not exist")
    if is_hf_dir(path):
        hf_config, tensors = hf.read_hf_dir(str(path))
        cfg = hf.config_from_hf(hf_config, name=Path(path).name or "hf", tensor_names=set(tensors))
        # read tensor by tensor as `place` puts them on the devices: never the whole model twice on the host
        params = hf.lazy_params_from_hf(tensors, cfg)
        return cfg, params, hf.router_bias_from_hf(tensors, cfg) if router_bias else None
    if (Path(path) / "config.json").exists():
        raise ShardError(f"{Path(path) / 'config.json'} is not a file")
    from shard.run.stored import StoredModel

    stored = StoredModel(path)
    cfg, lora, saved = _saved_model(stored.config, path)
    bias = stored.read({"router_bias": stored.tree["router_bias"]})["router_bias"] \
        if router_bias and "router_bias" in stored.tree else None
    if lora.rank:  # adapters alone: folded into the base weights they were trained on
        from shard.training.lora import fold, merge

        adapters = stored.read({"params": stored.tree["params"]})["params"]
        return cfg, fold(merge(adapters, lora_base(path, saved, cfg, lora)), lora), bias
    if stored.tree["params"]["embed"].shape[0] != cfg.padded_vocab:
        # saved before the tables were padded (shard.config.model.VOCAB_MULTIPLE): vocab_size rows, padded here
        return cfg, hf.pad_vocab(stored.read({"params": stored.tree["params"]})["params"], cfg), bias
    # read as `place` puts them into their shardings: never the whole model on the host
    return cfg, stored.lazy_params(), bias


def _saved_model(config_toml: str, path) -> tuple[ModelConfig, LoraConfig, dict]:
    """The model and LoRA settings of a checkpoint's saved config, and the config as read."""
    # only these are read: the run's other settings (ranges checked by newer versions) don't matter here
    saved = tomlfiles.parse(config_toml, f"the config saved with checkpoint {path}")
    if not isinstance(saved.get("model"), dict):  # the defaults would build another model than the weights'
        raise ShardError(f"checkpoint {path} holds no model config (it was saved without one: pass "
                         "config_toml=shard.config.to_toml(cfg) to Checkpoints.save)")
    resolved = resolve({"model": saved["model"], "lora": saved.get("lora", {})})
    return resolved.model, resolved.lora, saved


def load_lora(path: str | Path, base: bool = True) -> tuple[ModelConfig, LoraConfig, dict | None, dict, str]:
    """(model config, LoRA settings, base params (None without `base`), adapters, the run's init_from) of
    a LoRA checkpoint, on the host (numpy); a ShardError for a checkpoint without adapters."""
    if is_hf_dir(path):
        raise ShardError(f"{path} is a Hugging Face folder, not a LoRA checkpoint of shard's")
    from shard.run.stored import read_params

    adapters, config_toml, _ = read_params(path)
    cfg, lora, saved = _saved_model(config_toml, path)
    if not lora.rank:
        raise ShardError(f"checkpoint {path} holds no LoRA adapters (its run trained every weight, lora.rank 0)")
    return (cfg, lora, lora_base(path, saved, cfg, lora) if base else None, adapters,
            str(saved.get("init_from", "")))


def lora_base(path, saved: dict, cfg: ModelConfig, lora: LoraConfig) -> dict:
    """The base weights a LoRA checkpoint's adapters were trained on, on the host: its run's init_from,
    or the fresh init of its seed where it had none; checked against the fingerprint saved with it."""
    from shard.run.checkpoint_files import LORA_BASE_FINGERPRINT, find_checkpoint, saved_meta
    from shard.run.checksums import host_fingerprint
    from shard.sharding.rules import path_str

    init_from, seed = str(saved.get("init_from", "")), int(saved.get("seed", 0))
    if init_from:
        if not Path(init_from).exists():
            raise ShardError(f"the base weights of LoRA checkpoint {path} ({init_from}, its init_from) are gone")
        _, base = load(init_from)
    else:
        from flax import nnx

        from shard import models

        base = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(models.build(cfg, seed=seed))))
    import jax.numpy as jnp

    dtype = jnp.dtype(cfg.param_dtype)  # as the run held them, and fingerprinted them
    base = jax.tree.map(lambda x: np.asarray(x, dtype), base)
    directory, step = find_checkpoint(path)
    read = {path_str(p): [host_fingerprint(x), str(x.dtype)] for p, x in jax.tree_util.tree_flatten_with_path(base)[0]}
    check_lora_base(saved_meta(directory / str(step)).get(LORA_BASE_FINGERPRINT), read, path, saved)
    return base


def check_lora_base(saved_fp, read: dict, checkpoint, saved: dict) -> None:
    """The base weights read for a LoRA checkpoint (their fingerprint `read`, shard.run.checksums) are
    those its adapters were trained on (`saved_fp`, saved with it; checkpoints without one pass): a
    one-line error naming the base (`saved`: its run's config) and the first weight that differs."""
    from shard.run.checksums import first_mismatch

    if isinstance(saved_fp, dict) and (bad := first_mismatch(saved_fp, read)):
        where = saved.get("init_from") or f"the init of seed {saved.get('seed', 0)}"
        raise ShardError(f"the base weights of LoRA checkpoint {checkpoint} ({where}) are not those its adapters "
                         f"were trained on ({bad} differs)")


def saved_run_config(path: str | Path) -> TrainConfig | None:
    """The whole config a shard checkpoint was saved with (its data, batch, held-out share, ...), read
    without JAX; None for a Hugging Face folder, which has none."""
    if is_hf_dir(path):
        return None
    from shard.run.checkpoint_files import find_checkpoint, saved_config

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
    from shard.run.checkpoint_files import find_checkpoint, saved_meta

    directory, step = find_checkpoint(path)
    since = saved_meta(directory / str(step)).get("held_out_since")
    return since if isinstance(since, int) and not isinstance(since, bool) and since >= 0 else None


def place(params: dict, spec: StateSpec, part: str = "all") -> dict:
    """Host params into the spec's parameter shardings, after checking every shape against the model;
    `part` "base": the base weights of a LoRA spec alone. Params read lazily (a Hugging Face folder's,
    shard.run.hf.LazyParam) are placed one at a time, each device reading only its own shard of the HF
    tensors: the host holds the placed shards and one tensor being read, not a second copy of the model;
    a shard checkpoint's (shard.run.stored.StoredParam) are read by orbax straight into them."""
    from shard.run.stored import StoredParam
    from shard.run.hf import LazyParam

    spec.check_params_fit(params, "the weights", part=part)
    abstract, shardings = spec.abstract["params"], spec.shardings["params"]
    if part == "base" and spec.lora is not None:
        from shard.training.lora import split

        abstract, shardings = split(abstract)[1], split(shardings)[1]
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, LazyParam))
    if leaves and all(isinstance(x, StoredParam) and x.source is leaves[0].source for x in leaves):
        return leaves[0].source.place(params, shardings, jax.tree.map(lambda a: a.dtype, abstract))

    def put(x, a, sharding):
        if not isinstance(x, LazyParam):
            return jax.device_put(np.asarray(x, a.dtype), sharding)
        if x.tensor_dims and isinstance(sharding, NamedSharding):
            placed = _place_by_tensor(x, a, sharding)
        else:
            placed = jax.make_array_from_callback(a.shape, sharding, lambda index: np.asarray(x.read(index), a.dtype))
        x.forget()
        return placed

    return jax.tree.map(put, params, abstract, shardings, is_leaf=lambda x: isinstance(x, LazyParam))


def _place_by_tensor(x, a, sharding: NamedSharding) -> jax.Array:
    """A param stacked over HF tensors (layers, experts: x.tensor_dims leading dims) placed one HF tensor
    at a time: its sharded zeros, then each tensor's block written in place (the zeros donated), so the
    host holds the param's shards and one tensor being read, never the stack of a device's shard."""
    k = x.tensor_dims
    spec = spec_entries(sharding.spec, len(a.shape))
    block_sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec[k:]))
    key = (tuple(a.shape), np.dtype(a.dtype), sharding, k)
    placed = _zeros(*key[:3])()
    for at in np.ndindex(*a.shape[:k]):
        lead = tuple(slice(i, i + 1) for i in at)
        block = jax.make_array_from_callback(
            a.shape[k:], block_sharding,
            lambda index, lead=lead: np.asarray(x.read(lead + index), a.dtype)[(0,) * k])
        placed = _write_block(*key)(placed, block, np.asarray(at, np.int32))
        x.forget()
    return placed


@functools.cache
def _zeros(shape: tuple, dtype: np.dtype, sharding: NamedSharding):
    import jax.numpy as jnp

    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.cache
def _write_block(shape: tuple, dtype: np.dtype, sharding: NamedSharding, k: int):
    """(stack, block, at) -> the stack with `block` at its leading index `at` (k ints), the stack donated
    and updated in place on each device; the leading dims may be sharded (pipeline stages, experts): a
    device whose shard does not hold `at` writes back what it holds."""
    spec = spec_entries(sharding.spec, len(shape))

    def local(stack, block, at):
        starts, inside = [], True
        for d in range(k):
            offset = 0 if spec[d] is None else jax.lax.axis_index(spec[d]) * stack.shape[d]
            inside = inside & (at[d] >= offset) & (at[d] < offset + stack.shape[d])
            starts.append(jax.numpy.clip(at[d] - offset, 0, stack.shape[d] - 1))
        starts += [jax.numpy.int32(0)] * (stack.ndim - k)
        block = block.reshape((1,) * k + block.shape)
        held = jax.lax.dynamic_slice(stack, starts, block.shape)
        return jax.lax.dynamic_update_slice(stack, jax.numpy.where(inside, block, held), starts)

    specs = (PartitionSpec(*spec), PartitionSpec(*spec[k:]), PartitionSpec())
    return jax.jit(jax.shard_map(local, mesh=sharding.mesh, in_specs=specs, out_specs=specs[0], check_vma=False),
                   donate_argnums=0)


def placed_base(saved: dict, spec: StateSpec, source: str) -> dict:
    """The base weights of a LoRA run (its saved config `saved`: init_from, or the init of its seed) in
    the spec's shardings, for a resume: its adapters are all its checkpoints hold."""
    init_from = str(saved.get("init_from", ""))
    if not init_from:
        from shard.training.lora import init_part

        return init_part(spec, int(saved.get("seed", 0)), "base")
    if not Path(init_from).exists():
        raise ShardError(f"the base weights of LoRA checkpoint {source} ({init_from}, its init_from) are gone")
    return place(load(init_from)[1], spec, "base")


def state_from(params: dict, spec: StateSpec, seed: int, source: str, router_bias=None):
    """A fresh train state (step 0, new optimizer state) around loaded params, for `--init-from`, with the
    weights' MoE balancing bias (None: zeros) and empty amax histories where the spec's state holds them
    (state.placed_extras): returned as a
    shard.run.checkpoint.Restored so `prepare(restore=...)` takes it like a checkpoint."""
    import jax.numpy as jnp

    from shard.run.checkpoint_files import Restored

    if spec.lora is not None:  # the weights are the frozen base; fresh adapters beside them
        from shard.training.lora import init_part, merge

        placed = merge(init_part(spec, seed, "adapters"), place(params, spec, "base"))
    else:
        placed = place(params, spec)
    opt_state = jax.jit(spec.tx.init, out_shardings=spec.shardings["opt_state"])(spec.trainable(placed))
    step = jax.device_put(jnp.zeros((), jnp.int32), spec.shardings["step"])
    state = {"step": step, "params": placed, "opt_state": opt_state} | placed_extras(spec, router_bias)
    return Restored(step=0, state=state, position=0,
                    seed=seed, config_toml="", path=Path(source))
