"""LoRA adapters of the decoder's weights: their parameters, named with logical axes, and the low-rank
term they add to a projection's output.

Beside a targeted layer weight W of logical axes (*in, *out) sit A (layers, *in, lora_rank) and B
(layers, lora_rank, *out), stored in the layer stack as `<name>_lora_a` and `<name>_lora_b`, so the scan,
the pipeline's stage slices and every mesh preset treat them as they treat W: each dim is sharded by
the rule of the base weight's axis, and `lora_rank` maps to nothing. B starts at zero, so a fresh
adapter leaves the model as it was. The scale (alpha / rank) and the dropout rate are the run's
(`adapting`), set while a step is traced, as the activation layout is.
"""

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from shard.axes import LAYERS, LORA_RANK
from shard.config.params import ParamSpec
from shard.config.finetune import LORA_TARGETS, LoraConfig
from shard.errors import ShardError

# How many leading dims of each targeted weight are its input (the rest its output): wo maps
# (heads, head_dim) to embed, every other one a single input dim.
INPUT_DIMS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
A_SUFFIX, B_SUFFIX = "_lora_a", "_lora_b"


def adapter_names(target: str) -> tuple[str, str]:
    return target + A_SUFFIX, target + B_SUFFIX


def is_adapter(name: str) -> bool:
    return name.endswith(A_SUFFIX) or name.endswith(B_SUFFIX)


def adapter_axes(name: str, layer: dict[str, ParamSpec]) -> tuple:
    """The logical axes of adapter `name` (without the layers dim), from its base weight's in `layer`
    (shard.config.params.dense_layer_params)."""
    target, half = name.rsplit("_lora_", 1)
    base, n = layer[target].axes, INPUT_DIMS[target]
    return (*base[:n], LORA_RANK) if half == "a" else (LORA_RANK, *base[n:])


def adapter_params(rngs, lora: LoraConfig, layer: dict[str, ParamSpec], n_layers: int, make_param, dtype) -> dict:
    """A (truncated normal, std 1/sqrt(fan-in)) and B (zeros) of every target, with their logical axes,
    beside the targets of `layer` (shard.config.params.dense_layer_params); `make_param` is the model's
    (rngs, shape, axes, std, dtype) -> nnx.Param."""
    import math

    out = {}
    for target in lora.targets:
        n = INPUT_DIMS[target]
        ins, outs = layer[target].shape[:n], layer[target].shape[n:]
        a, b = adapter_names(target)
        out[a] = make_param(rngs, (n_layers, *ins, lora.rank), (LAYERS, *adapter_axes(a, layer)),
                            math.prod(ins) ** -0.5, dtype)
        out[b] = make_param(rngs, (n_layers, lora.rank, *outs), (LAYERS, *adapter_axes(b, layer)),
                            0, dtype)
    return out


# --- the run's settings while a step is traced ----------------------------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[LoraConfig, jax.Array | None] | None] = contextvars.ContextVar(
    "shard_lora", default=None)


@contextlib.contextmanager
def adapting(lora: LoraConfig | None, dropout_key: jax.Array | None = None) -> Iterator[None]:
    """While tracing under this context, adapters in the params add their term with this config's scale,
    and dropout (lora.dropout > 0) draws from `dropout_key` (None: no dropout, as in evaluation)."""
    token = _ACTIVE.set((lora, dropout_key) if lora is not None and lora.rank else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def dropout_keys(n_layers: int) -> jax.Array | None:
    """One dropout key per layer of the stack being scanned, or None where no dropout runs."""
    active = _ACTIVE.get()
    if active is None or active[1] is None or not active[0].dropout:
        return None
    return jax.random.split(active[1], n_layers)


def with_delta(y, x, p: dict, target: str, key: jax.Array | None = None):
    """`y` (the base projection of `x`) plus (alpha / rank) * dropout(x) A B where `p` holds target's
    adapters; `y` unchanged where it holds none."""
    a_name, b_name = adapter_names(target)
    if a_name not in p:
        return y
    active = _ACTIVE.get()
    if active is None:
        raise ShardError("the params hold LoRA adapters but no LoRA settings are active (shard.models.lora.adapting)")
    lora = active[0]
    if key is not None and lora.dropout:
        key = jax.random.fold_in(key, LORA_TARGETS.index(target))
        keep = jax.random.bernoulli(key, 1.0 - lora.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - lora.dropout), 0).astype(x.dtype)
    xa = jnp.tensordot(x, p[a_name], INPUT_DIMS[target])  # (B, T, R)
    delta = jnp.tensordot(xa, p[b_name], 1)  # (B, T, *out)
    return y + (lora.scale * delta).astype(y.dtype)
