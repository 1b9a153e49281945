"""LoRA in training: the params split into the adapters (trained, the optimizer's) and the frozen base,
the gradient of the loss with respect to the adapters alone, and adapters folded into their base
weights (W + (alpha / rank) A B) for export. The adapters themselves are shard.models.lora's."""

import jax
import numpy as np

from shard.config.finetune import LoraConfig
from shard.models.lora import adapter_names, is_adapter


def split(params: dict) -> tuple[dict, dict]:
    """(adapters, base) of a params tree: the adapters are `{"layers": {name: ...}}`."""
    layers = params["layers"]
    adapters = {"layers": {k: v for k, v in layers.items() if is_adapter(k)}}
    base = dict(params) | {"layers": {k: v for k, v in layers.items() if not is_adapter(k)}}
    return adapters, base


def merge(adapters: dict, base: dict) -> dict:
    """The params tree of `split`'s two parts."""
    return dict(base) | {"layers": dict(base["layers"]) | dict(adapters["layers"])}


def has_adapters(params: dict) -> bool:
    return isinstance(params, dict) and isinstance(params.get("layers"), dict) and any(
        is_adapter(k) for k in params["layers"])


def grad_of_trained(spec, loss_fn):
    """`loss_fn(params, *args) -> (objective, aux)` as `(params, *args) -> ((objective, aux), grads)` in
    what the run trains: every parameter, or with LoRA (`spec.lora`) the adapters alone (grad_of_adapters)."""
    return jax.value_and_grad(loss_fn, has_aux=True) if spec.lora is None else grad_of_adapters(loss_fn)


def grad_of_adapters(loss_fn):
    """`loss_fn(params, *args) -> (objective, aux)` as `(params, *args) -> ((objective, aux), grads)`
    with grads of the adapters only: the base weights are constants of the differentiation, so no
    gradient of theirs is computed, kept or reduced across devices."""
    value_and_grad = jax.value_and_grad(lambda a, base, *args: loss_fn(merge(a, base), *args), has_aux=True)

    def fn(params, *args):
        adapters, base = split(params)
        return value_and_grad(adapters, base, *args)

    return fn


def init_part(spec, seed: int, part: str) -> dict:
    """The "adapters" or the "base" of a fresh init (`spec`'s model and LoRA, `seed`), created in their
    shardings; what the other part would be is never computed."""
    from flax import nnx

    from shard import models

    index = 0 if part == "adapters" else 1

    def init():
        params = nnx.to_pure_dict(nnx.state(models.build(spec.model, seed=seed, lora=spec.lora)))
        return split(params)[index]

    return jax.jit(init, out_shardings=split(spec.shardings["params"])[index])()


def dropout_key(step: jax.Array) -> jax.Array:
    """The dropout masks' key at a train step (the same masks on every layout and after a resume)."""
    return jax.random.fold_in(jax.random.key(0x10BA), step)


def fold(params: dict, lora: LoraConfig) -> dict:
    """Host params (numpy) with their adapters folded into the base weights, in float32: W + scale *
    A B in W's layout, and no adapter left (a plain model)."""
    _, base = split(params)
    layers = dict(base["layers"])
    for target in lora.targets:
        a_name, b_name = adapter_names(target)
        if a_name not in params["layers"]:
            continue
        a, b = np.asarray(params["layers"][a_name], np.float32), np.asarray(params["layers"][b_name], np.float32)
        w = np.asarray(layers[target], np.float32)
        # (L, *in, R) x (L, R, *out) -> (L, *in, *out), per layer
        ab = np.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], b.shape[1], -1))
        layers[target] = (w + lora.scale * ab.reshape(w.shape)).astype(np.asarray(layers[target]).dtype)
    return base | {"layers": layers}
