"""FP8 matmuls (docs/performance.md, shard.config.precision): each operand quantized with a float32
scale (amax / the format's largest value; current scaling, this step's amax), `dot_general` on the
float8 operands accumulating in float32, and the scales multiplied in after: the form XLA:GPU's GEMM
rewriter turns into a cuBLASLt FP8 GEMM. E4M3 for weights and activations, E5M2 (wider range) for
the gradients, through a custom VJP whose two backward matmuls are FP8 as well.

`fp8_tensorwise`: one scale per tensor. `fp8_rowwise`: one per row of each operand along the dims it
contracts in that matmul (per token and per output channel forward; the backward requantizes along its
own contracting dims, as torchtitan's rowwise recipe does).

Quantization is flax's (`flax.linen.fp8_ops.quantize`: divide, clip to the format's range, cast);
the recipes are shard's: flax's FP8 ops keep delayed scaling only, as Flax modules' state, and qwix's
rules match module paths, while shard's model is one module whose weights are picked by parameter path.
"""

import functools

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from shard.sharding.rules import active_layout

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16 = "bf16"
DELAYED = "fp8_delayed"
ROWWISE = {"fp8_tensorwise": False, "fp8_rowwise": True, DELAYED: False}  # delayed without a history: current


def scale_of(x: jax.Array, fp8_dtype, axes: tuple[int, ...] | None = None) -> jax.Array:
    """float32 scale amax / max(fp8_dtype), the amax over `axes` (None: the whole tensor; kept as size-1
    dims), so the largest value maps to the format's largest; 1 where the amax is 0 (zeros stay zeros).
    A non-finite amax gives a non-finite scale, so an inf or nan still reaches the loss and the guard."""
    return _scale(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=axes is not None), fp8_dtype)


def _scale(amax: jax.Array, fp8_dtype) -> jax.Array:
    """amax / max(fp8_dtype) in float32; 1 where the amax is 0."""
    return jnp.where(amax > 0, amax / jnp.finfo(fp8_dtype).max.astype(jnp.float32), 1.0)


def quantize(x: jax.Array, fp8_dtype, axes: tuple[int, ...] | None = None,
             scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(x / scale saturated to the format's range and rounded to nearest even, in fp8_dtype; the float32
    scale): this step's (`scale_of` over `axes`) unless a `scale` is given (delayed scaling's)."""
    scale = scale_of(x, fp8_dtype, axes) if scale is None else scale.astype(jnp.float32)
    return fp8_ops.quantize(x.astype(jnp.float32), fp8_dtype, scale, jnp.float32), scale


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    return fp8_ops.dequantize(q, jnp.float32, scale)


def scaled_einsum(subscripts: str, a, b, a_dtype, b_dtype, rowwise: bool, scales=(None, None)) -> jax.Array:
    """float32 `einsum(subscripts, a, b)` with a and b quantized to a_dtype and b_dtype: the dot on the
    float8 operands, then the product of their scales (this step's, or the per-tensor `scales` given:
    delayed scaling's; rowwise: per row along each one's contracting dims, broadcast to the output by
    an outer product)."""
    ins, out = subscripts.split("->")
    sa, sb = ins.split(",")
    contract_a = tuple(i for i, c in enumerate(sa) if c not in out) if rowwise else None
    contract_b = tuple(i for i, c in enumerate(sb) if c not in out) if rowwise else None
    qa, scale_a = quantize(a, a_dtype, contract_a, scales[0])
    qb, scale_b = quantize(b, b_dtype, contract_b, scales[1])
    y = jnp.einsum(subscripts, qa, qb, preferred_element_type=jnp.float32)
    if not rowwise:
        return y * (scale_a * scale_b)
    free_a, free_b = "".join(c for c in sa if c in out), "".join(c for c in sb if c in out)
    scale = jnp.einsum(f"{free_a},{free_b}->{out}", jnp.squeeze(scale_a, contract_a), jnp.squeeze(scale_b, contract_b))
    return y * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def fp8_einsum(subscripts: str, x: jax.Array, w: jax.Array, rowwise: bool = False) -> jax.Array:
    """`einsum(subscripts, x, w)` (an activation and a weight, each letter once per operand) in FP8:
    E4M3 operands forward; backward, the incoming gradient in E5M2 against the E4M3 weight (dx) and
    activation (dw). The result in x's dtype."""
    return scaled_einsum(subscripts, x, w, E4M3, E4M3, rowwise).astype(x.dtype)


def _fp8_einsum_fwd(subscripts, x, w, rowwise):
    return fp8_einsum(subscripts, x, w, rowwise), (x, w)


def _fp8_einsum_bwd(subscripts, rowwise, saved, g):
    x, w = saved
    ins, out = subscripts.split("->")
    sx, sw = ins.split(",")
    dx = scaled_einsum(f"{out},{sw}->{sx}", g, w, E5M2, E4M3, rowwise)
    dw = scaled_einsum(f"{sx},{out}->{sw}", x, g, E4M3, E5M2, rowwise)
    return dx.astype(x.dtype), dw.astype(w.dtype)


fp8_einsum.defvjp(_fp8_einsum_fwd, _fp8_einsum_bwd)


# --- delayed scaling: amax histories (newest first) of the activation, the weight and the gradient ---


def delayed_scale(history: jax.Array, x: jax.Array, fp8_dtype) -> jax.Array:
    """A per-tensor scale from the largest amax in `history` (earlier steps'); this step's amax while
    the history is still empty (the first step), so the first step does not saturate or flush to zero."""
    past = jnp.max(history)
    return _scale(jnp.where(past > 0, past, jnp.max(jnp.abs(x.astype(jnp.float32)))), fp8_dtype)


def pushed(history: jax.Array, x: jax.Array) -> jax.Array:
    """The history with this step's amax of x first and its oldest entry dropped."""
    return jnp.roll(history, 1).at[0].set(jnp.max(jnp.abs(x.astype(jnp.float32))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def delayed_einsum(subscripts: str, x: jax.Array, w: jax.Array, history: dict) -> jax.Array:
    """`fp8_einsum` (tensorwise) with scales from amax histories ({"x", "w", "g"}: (H,) float32 each).
    The histories' "gradient" is their update (this step's amaxes pushed in), which the train step
    takes as the new histories (flax's fp8_ops "overwrite with gradient", without its max-dtype: the
    step takes the maximum over microbatches itself)."""
    return _delayed_fwd(subscripts, x, w, history)[0]


def _delayed_fwd(subscripts, x, w, history):
    sx, sw = delayed_scale(history["x"], x, E4M3), delayed_scale(history["w"], w, E4M3)
    return scaled_einsum(subscripts, x, w, E4M3, E4M3, False, (sx, sw)).astype(x.dtype), (x, w, sx, sw, history)


def _delayed_bwd(subscripts, saved, g):
    x, w, sx, sw, history = saved
    ins, out = subscripts.split("->")
    x_letters, w_letters = ins.split(",")
    sg = delayed_scale(history["g"], g, E5M2)
    dx = scaled_einsum(f"{out},{w_letters}->{x_letters}", g, w, E5M2, E4M3, False, (sg, sw))
    dw = scaled_einsum(f"{x_letters},{out}->{w_letters}", x, g, E4M3, E5M2, False, (sx, sg))
    new = {"x": pushed(history["x"], x), "w": pushed(history["w"], w), "g": pushed(history["g"], g)}
    return dx.astype(x.dtype), dw.astype(w.dtype), new


delayed_einsum.defvjp(_delayed_fwd, _delayed_bwd)


def matmul(subscripts: str, x: jax.Array, w: jax.Array, recipe: str = BF16, history: dict | None = None):
    """`einsum(subscripts, x, w)` by a weight's recipe: plain in the operands' dtype for bf16 (the
    compute dtype), `delayed_einsum` for fp8_delayed with its histories (without them, as in evaluation
    and generation: current tensorwise scaling), else `fp8_einsum`."""
    if recipe == BF16:
        return jnp.einsum(subscripts, x, w)
    if recipe == DELAYED and history is not None:
        return delayed_einsum(subscripts, x, w, history)
    return fp8_einsum(subscripts, x, w, ROWWISE[recipe])


def fusable(*recipes: str) -> bool:
    """Can weights of these recipes run as one matmul (q, k, v; gate and up)? The same recipe, and
    not fp8_delayed, whose histories are each weight's own."""
    return len(set(recipes)) == 1 and recipes[0] != DELAYED


def stack_recipes(stack: str) -> dict[str, str]:
    """The recipe of each weight of a layer stack (`layers`, `dense_layers`, `mtp/layers`) under the
    layout being traced (shard.config.precision resolved it; bf16 where it names none)."""
    layout = active_layout()
    table = layout.precision if layout is not None else {}
    prefix = stack + "/"
    return {path[len(prefix):]: r for path, r in table.items() if path.startswith(prefix) and "/" not in path[len(prefix):]}
