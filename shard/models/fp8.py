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

from shard.config.precision import BF16, DELAYED, gathered_weights
from shard.models import matmuls
from shard.parallel.manual import varying_axes
from shard.sharding.rules import active_layout, constrain

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
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


def scaled_einsum(subscripts: str, a, b, a_dtype, b_dtype, rowwise: bool, scales=(None, None),
                  dtype=jnp.float32) -> jax.Array:
    """`einsum(subscripts, a, b)` in `dtype` with a and b quantized to a_dtype and b_dtype: the dot on the
    float8 operands, then the product of their scales (this step's, or the per-tensor `scales` given:
    delayed scaling's; rowwise: per row along each one's contracting dims, broadcast to the output by
    an outer product)."""
    ins, out = subscripts.split("->")
    sa, sb = ins.split(",")
    contract_a = tuple(i for i, c in enumerate(sa) if c not in out) if rowwise else None
    contract_b = tuple(i for i, c in enumerate(sb) if c not in out) if rowwise else None
    qa, scale_a = quantize(a, a_dtype, contract_a, scales[0])
    qb, scale_b = quantize(b, b_dtype, contract_b, scales[1])
    if not rowwise:
        return quantized_einsum(subscripts, qa, scale_a, qb, scale_b, dtype)
    y = jnp.einsum(subscripts, qa, qb, preferred_element_type=dtype)
    free_a, free_b = "".join(c for c in sa if c in out), "".join(c for c in sb if c in out)
    scale = jnp.einsum(f"{free_a},{free_b}->{out}", jnp.squeeze(scale_a, contract_a), jnp.squeeze(scale_b, contract_b))
    return y * scale.astype(dtype)


def quantized_einsum(subscripts: str, qa, scale_a, qb, scale_b, dtype=jnp.float32) -> jax.Array:
    """`einsum` of two float8 operands with per-tensor scales, in `dtype`: the dot (accumulating in float32
    on an FP8 GEMM, written in `dtype`), then the scales."""
    return jnp.einsum(subscripts, qa, qb, preferred_element_type=dtype) * (scale_a * scale_b).astype(dtype)


def gathered(w: jax.Array, gather: tuple, scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(w quantized to E4M3 where it is stored, then put in its compute layout; the scale): a weight
    that arrives as stored (FSDP: a shard) is all-gathered as float8 bytes. Its amax (`scale` not
    given) is the largest over all shards, one float32 scalar reduced across them, so each element
    quantizes as it would on one device. `gather`: the weight's logical axes. Constrained only to the
    compute layout, sharding propagation moves the cast after the gather (shard.models.llama's
    compute_weight says so for the compute dtype)."""
    q, scale = quantize(w, E4M3, scale=scale)
    return constrain(constrain(q, gather, param=True), gather), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def fp8_einsum(subscripts: str, x: jax.Array, w: jax.Array, rowwise: bool = False,
               gather: tuple | None = None) -> jax.Array:
    """`einsum(subscripts, x, w)` (an activation and a weight, each letter once per operand) in FP8:
    E4M3 operands forward; backward, the incoming gradient in E5M2 against the E4M3 weight (dx) and
    activation (dw). The result in x's dtype. `gather` (tensorwise): w arrives as stored, with these
    logical axes, and is quantized there and gathered in float8 (`gathered`); its gradient leaves in
    the compute layout, and the caller's constraint reduce-scatters it."""
    if gather is None:
        return scaled_einsum(subscripts, x, w, E4M3, E4M3, rowwise).astype(x.dtype)
    return _fp8_einsum_fwd(subscripts, x, w, rowwise, gather)[0]


def _fp8_einsum_fwd(subscripts, x, w, rowwise, gather):
    if gather is None:
        return fp8_einsum(subscripts, x, w, rowwise), (x, w)
    qx, sx = quantize(x, E4M3)
    qw, sw = gathered(w, gather)
    # the float8 operands, which the backward's matmuls take as they are, and a scalar of w's dtype (the
    # dtype its gradient must have)
    return quantized_einsum(subscripts, qx, sx, qw, sw).astype(x.dtype), ((qx, sx), (qw, sw, jnp.zeros((), w.dtype)))


def _fp8_einsum_bwd(subscripts, rowwise, gather, saved, g):
    x, w = saved
    to_x, to_w = matmuls.transposed(subscripts)
    if gather is None:
        dx = scaled_einsum(to_x, g, w, E5M2, E4M3, rowwise)
        # written in the weight's dtype, in which its partial sums are reduced (as below)
        dw = scaled_einsum(to_w, x, g, E4M3, E5M2, rowwise, dtype=w.dtype)
        return dx.astype(x.dtype), dw
    (qx, scale_x), (qw, scale_w, w_dtype) = x, w  # the forward's float8 operands, weight gathered
    dx, dw = _quantized_grads(subscripts, qx, scale_x, qw, scale_w, *quantize(g, E5M2), w_dtype.dtype)
    return dx.astype(g.dtype), dw


def _quantized_grads(subscripts, qx, sx, qw, sw, qg, sg, w_dtype):
    """dx (float32) and dw of `quantized_einsum(subscripts, qx, sx, qw, sw)` from the float8 gradient (qg,
    sg), dw written in the weight's dtype, in which its partial sums are then reduced or reduce-scattered
    (float32, they moved twice a bf16 gradient's bytes)."""
    to_x, to_w = matmuls.transposed(subscripts)
    return quantized_einsum(to_x, qg, sg, qw, sw), quantized_einsum(to_w, qx, sx, qg, sg, w_dtype)


fp8_einsum.defvjp(_fp8_einsum_fwd, _fp8_einsum_bwd)


# --- delayed scaling: amax histories (newest first) of the activation, the weight and the gradient ---


def delayed_scale(history: jax.Array, amax: jax.Array, fp8_dtype) -> jax.Array:
    """A per-tensor scale from the largest amax in `history` (earlier steps'); this step's `amax` while
    the history is still empty (the first step), so the first step does not saturate or flush to zero."""
    past = jnp.max(history)
    return _scale(jnp.where(past > 0, past, amax), fp8_dtype)


def pushed(history: jax.Array, amax: jax.Array) -> jax.Array:
    """The history with this step's amax first and its oldest entry dropped."""
    return jnp.roll(history, 1).at[0].set(amax)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def delayed_einsum(subscripts: str, x: jax.Array, w: jax.Array, history: dict, gather: tuple | None = None) -> jax.Array:
    """`fp8_einsum` (tensorwise) with scales from amax histories ({"x", "w", "g"}: (H,) float32 each).
    The histories' "gradient" is their update (this step's amaxes pushed in), which the train step
    takes as the new histories (flax's fp8_ops "overwrite with gradient", without its max-dtype: the
    step takes the maximum over microbatches itself). `gather`: as in `fp8_einsum`."""
    return _delayed_fwd(subscripts, x, w, history, gather)[0]


def _delayed_fwd(subscripts, x, w, history, gather):
    x_amax, w_amax = _amax(x), _amax(w)
    qx, sx = quantize(x, E4M3, scale=delayed_scale(history["x"], x_amax, E4M3))
    sw = delayed_scale(history["w"], w_amax, E4M3)
    qw, sw = gathered(w, gather, sw) if gather is not None else quantize(w, E4M3, scale=sw)
    y = quantized_einsum(subscripts, qx, sx, qw, sw).astype(x.dtype)
    # the float8 operands (the weight gathered, when it arrived as stored) and this step's amaxes, which the
    # backward takes as they are, and a scalar of w's dtype for its gradient's
    return y, (qx, qw, jnp.zeros((), w.dtype), sx, sw, x_amax, w_amax, history)


def _delayed_bwd(subscripts, gather, saved, g):
    qx, qw, w_dtype, sx, sw, x_amax, w_amax, history = saved
    g_amax = _amax(g)
    qg, sg = quantize(g, E5M2, scale=delayed_scale(history["g"], g_amax, E5M2))
    dx, dw = _quantized_grads(subscripts, qx, sx, qw, sw, qg, sg, w_dtype.dtype)
    new = {"x": pushed(history["x"], x_amax), "w": pushed(history["w"], w_amax), "g": pushed(history["g"], g_amax)}
    return dx.astype(g.dtype), dw, new


delayed_einsum.defvjp(_delayed_fwd, _delayed_bwd)


# --- a mixture of experts' grouped matmul ---


def _scale_over(a: jax.Array, fp8_dtype, axes: tuple[str, ...]) -> jax.Array:
    """A per-tensor scale from a's amax, the largest over the manual mesh `axes` (none: a's own)."""
    amax = _amax(a)
    return _scale(jax.lax.pmax(amax, axes) if axes else amax, fp8_dtype)


# dw of a grouped matmul: (M, D) x (M, F) contracted over the ragged M, one (D, F) per group
_RAGGED_CONTRACT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_ragged_dot(x_md: jax.Array, w_edf: jax.Array, sizes_e: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
    """`jax.lax.ragged_dot(x, w, sizes)` (the experts' grouped matmul: row group e against w[e]) in FP8,
    tensorwise: E4M3 operands forward; backward, the E5M2 gradient against the E4M3 weight (dx, a
    grouped matmul) and activation (dw, contracted over each group's rows). `axes`: the manual mesh axes
    the rows are split over (dropless routing's shard_map), whose amaxes are max-reduced so that every
    device scales as one device would. The result in x's dtype."""
    return _ragged_fwd(x_md, w_edf, sizes_e, axes)[0]


def _ragged_fwd(x_md, w_edf, sizes_e, axes):
    qx, sx = quantize(x_md, E4M3, scale=_scale_over(x_md, E4M3, axes))
    qw, sw = quantize(w_edf, E4M3, scale=_scale_over(w_edf, E4M3, axes))
    y = jax.lax.ragged_dot(qx, qw, sizes_e, preferred_element_type=jnp.float32) * (sx * sw)
    # a scalar of w: its dtype and the manual axes it varies over, which its gradient must have
    return y.astype(x_md.dtype), (qx, sx, qw, sw, sizes_e, w_edf[(0,) * w_edf.ndim] * 0)


def _ragged_bwd(axes, saved, g_mf):
    qx, sx, qw, sw, sizes_e, like_w = saved
    qg, sg = quantize(g_mf, E5M2, scale=_scale_over(g_mf, E5M2, axes))
    dx = jax.lax.ragged_dot(qg, jnp.swapaxes(qw, 1, 2), sizes_e, preferred_element_type=jnp.float32) * (sg * sw)
    dw = jax.lax.ragged_dot_general(qx, qg, sizes_e, _RAGGED_CONTRACT, preferred_element_type=like_w.dtype)
    dw = dw * (sx * sg).astype(like_w.dtype)
    # inside a shard_map, w shared by devices whose rows differ: the sum of their parts (pvary's transpose)
    summed = tuple(sorted(varying_axes(dw) - varying_axes(like_w)))
    return dx.astype(g_mf.dtype), jax.lax.psum(dw, summed) if summed else dw, None


fp8_ragged_dot.defvjp(_ragged_fwd, _ragged_bwd)


def ragged_matmul(x_md: jax.Array, w_edf: jax.Array, sizes_e: jax.Array, recipe: str = BF16,
                  axes: tuple[str, ...] = ()) -> jax.Array:
    """The experts' grouped matmul by their weight's recipe: `jax.lax.ragged_dot` in the operands' dtype
    for bf16, else `fp8_ragged_dot` (tensorwise: the only recipe the rules allow the experts)."""
    if recipe == BF16:
        return jax.lax.ragged_dot(x_md, w_edf, sizes_e)
    return fp8_ragged_dot(x_md, w_edf, sizes_e, axes)


def matmul(subscripts: str, x: jax.Array, w: jax.Array, recipe: str = BF16, history: dict | None = None,
           gather: tuple | None = None):
    """`einsum(subscripts, x, w)` by a weight's recipe: in the operands' dtype for bf16 (the compute
    dtype: `matmuls.einsum`), `delayed_einsum` for fp8_delayed with its histories (without them, as in evaluation
    and generation: current tensorwise scaling), else `fp8_einsum`. `gather`: w arrives as stored
    (a recipe in GATHERED), with these logical axes, to be quantized before its gather."""
    if recipe == BF16:
        return matmuls.einsum(subscripts, x, w)
    if recipe == DELAYED and history is not None:
        return delayed_einsum(subscripts, x, w, history, gather)
    return fp8_einsum(subscripts, x, w, ROWWISE[recipe], gather)


def fusable(*recipes: str) -> bool:
    """Can weights of these recipes run as one matmul (q, k, v; gate and up)? The same recipe, and
    not fp8_delayed, whose histories are each weight's own."""
    return len(set(recipes)) == 1 and recipes[0] != DELAYED


def stack_recipes(stack: str) -> dict[str, str]:
    """The recipe of each weight of a layer stack (`layers`, `dense_layers`, `mtp/layers`) under the
    layout being traced (shard.config.precision resolved it; bf16 where it names none)."""
    return _of_stack(_precision(), stack)


def stack_gathered(stack: str, model) -> set[str]:
    """The weights of a layer stack (of `model`: the stack's own config) that reach their matmul as
    stored, which quantizes them and gathers the float8 bytes (shard.config.precision.gathered_weights)."""
    return set(_of_stack(dict.fromkeys(gathered_weights(_precision(), model)), stack))


def _precision() -> dict[str, str]:
    layout = active_layout()
    return layout.precision if layout is not None else {}


def _of_stack(table: dict, stack: str) -> dict:
    """`table`'s entries of the stack's own weights, by weight name."""
    prefix = stack + "/"
    return {path[len(prefix):]: v for path, v in table.items() if path.startswith(prefix) and "/" not in path[len(prefix):]}
