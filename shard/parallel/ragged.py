"""The ragged all-to-all: each device sends a different number of rows to each device of a mesh axis.

`ragged_all_to_all` has the semantics of `jax.lax.ragged_all_to_all` with one slice per peer: device i
sends rows `operand[input_offsets[j] : + send_sizes[j]]` to device j, which writes them into its
`output` at the offset i named for it (`output_offsets[j]` on i); `recv_sizes[i]` on j is what i sends
it. Where the backend lowers the op (GPU, TPU) it is that op, which moves only the rows sent. XLA:CPU
does not (`UNIMPLEMENTED: HLO opcode ragged-all-to-all`, jax-ml/jax#34755); there `padded` gives the
same result from a static all-to-all of each slice padded to `max_send` rows (the caller's bound on a
slice) and a scatter into `output`, moving the padding too: the twin that runs a GPU code path on the
simulated CPU devices (dropless expert parallel's, in the tests). Both are differentiable (jax
transposes the op into the reverse ragged all-to-all; the twin is an all-to-all, a gather and a
scatter).
"""

import jax
import jax.numpy as jnp


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name, max_send: int,
                      padded: bool) -> jax.Array:
    """Inside a `shard_map` manual over `axis_name`: the ragged exchange (module docstring), by
    `jax.lax.ragged_all_to_all` or, `padded`, by a static all-to-all of slices of `max_send` rows.
    The four index arrays are int32 of shape (n,), one slice per device of the axis."""
    if not padded:
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axis_name)
    rows_js = input_offsets[:, None] + jnp.arange(max_send, dtype=input_offsets.dtype)
    sent_js = jnp.arange(max_send) < send_sizes[:, None]
    slices_js = jnp.take(operand, jnp.where(sent_js, rows_js, 0), axis=0)  # (n, max_send, ...) a slice a peer
    slices_js = jnp.where(_to_rank(sent_js, slices_js.ndim), slices_js, jnp.zeros((), operand.dtype))
    got_is = jax.lax.all_to_all(slices_js, axis_name, 0, 0)  # (source, max_send, ...)
    at_i = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source's rows go here
    into_is = at_i[:, None] + jnp.arange(max_send, dtype=at_i.dtype)
    into_is = jnp.where(jnp.arange(max_send) < recv_sizes[:, None], into_is, output.shape[0])  # past the end: none
    return output.at[into_is.reshape(-1)].set(got_is.reshape(-1, *output.shape[1:]), mode="drop")


def _to_rank(mask: jax.Array, ndim: int) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))
