"""The compute-dtype matmul: `einsum` in the operands' dtype, written as float32 and rounded where that
runs faster, with the same rounding.

XLA:CPU (jaxlib 0.10) runs a bfloat16 dot that writes bfloat16 as a float32 dot: it converts both
operands to float32 and the result back, 73-124 GFLOP/s on the reference model's shapes on the
development machine. The same dot writing float32 (`preferred_element_type`) stays bfloat16 on its
YNNPACK kernels, 250-340 GFLOP/s, and 210-330 with the rounding to bfloat16 after it
(docs/performance.md). The result is the same float32 sum of exact bfloat16 products rounded once to
bfloat16, added up in the kernel's order. So on a CPU the forward matmul and both of its backward
matmuls (a custom VJP: plain autodiff would transpose the float32 output's dot into float32 x bfloat16
dots, which XLA:CPU widens again) write float32 and round to the operands' dtype. Elsewhere (GPUs:
cuBLAS accumulates in float32 and writes bfloat16 itself) and in float32, `einsum` is jnp.einsum.
The custom VJP has no forward-mode rule (jax.jvp, jax.linear_transpose), which shard does not use.
"""

import functools

import jax
import jax.numpy as jnp

ROUNDED_ON = ("cpu",)  # platforms whose bfloat16 matmuls run faster written as float32, then rounded


def rounds_float32(dtype) -> bool:
    """Are matmuls of `dtype` operands written as float32 and rounded (bfloat16 on a CPU; float16's
    rates were not measured)?"""
    return jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() in ROUNDED_ON


def rounded_einsum(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(subscripts, x, w)`, written as float32 and rounded to the operands' dtype where
    `rounds_float32`; no custom gradient (for use inside one)."""
    if x.dtype != w.dtype or not rounds_float32(x.dtype):
        return jnp.einsum(subscripts, x, w)
    return jnp.einsum(subscripts, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def einsum(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(subscripts, x, w)` of two operands of one dtype; its forward and backward matmuls as
    `rounded_einsum` where `rounds_float32` and the subscripts transpose plainly (`transposed`)."""
    if x.dtype != w.dtype or not rounds_float32(x.dtype) or transposed(subscripts) is None:
        return jnp.einsum(subscripts, x, w)
    return _rounded(subscripts, x, w)


def transposed(subscripts: str) -> tuple[str, str] | None:
    """The subscripts of the two backward matmuls of `x, w -> out` (dx from the output's gradient and w,
    dw from x and the output's gradient), where each operand's indices appear, once, in the other
    operand or the output; None otherwise (an ellipsis, a trace, a sum within one operand)."""
    if "..." in subscripts or "->" not in subscripts:
        return None
    ins, out = subscripts.split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    a, b = parts
    for mine, other in ((a, b), (b, a)):
        if len(set(mine)) != len(mine) or any(c not in other and c not in out for c in mine):
            return None
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


def einsum_grads(subscripts: str, x: jax.Array, w: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The gradients of x and w of `einsum(subscripts, x, w)` given the output's gradient `g`, each
    matmul as `rounded_einsum` and in its operand's dtype."""
    to_x, to_w = transposed(subscripts)
    g = g.astype(x.dtype)
    return rounded_einsum(to_x, g, w).astype(x.dtype), rounded_einsum(to_w, x, g).astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rounded(subscripts: str, x, w):
    return rounded_einsum(subscripts, x, w)


def _rounded_fwd(subscripts, x, w):
    return rounded_einsum(subscripts, x, w), (x, w)


def _rounded_bwd(subscripts, saved, g):
    return einsum_grads(subscripts, *saved, g)


_rounded.defvjp(_rounded_fwd, _rounded_bwd)
