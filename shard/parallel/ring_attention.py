"""Ring attention for context parallelism: queries stay put, key/value blocks travel round a ring.

With the sequence split into n blocks over the mesh axes that `length` maps to, each device holds one
query block and, over n ticks, sees every key/value block (passed to its neighbour by ppermute),
folding each into an online softmax (flash-attention style). Memory per device is O(T/n); causal
masking uses global positions, so blocks wholly in the future contribute nothing.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from shard.axes import LENGTH
from shard.rules import active_layout

_NEG = -1e30  # finite "minus infinity": a fully masked block must not produce inf - inf


def context_axes() -> tuple[str, ...]:
    """Mesh axes that split the sequence in the layout being traced (empty when not context parallel)."""
    layout = active_layout()
    return () if layout is None else layout.mesh_axes(LENGTH)


def ring_attention(q_btnh, k_bskh, v_bskh, axes: tuple[str, ...], *, causal: bool = True, mesh=None):
    """Grouped-query attention with the length dim split over `axes`; equals full attention."""
    if mesh is None:
        mesh = active_layout().mesh
    spec = P(None, axes if len(axes) > 1 else axes[0])
    fn = jax.shard_map(lambda q, k, v: _ring(q, k, v, axes, causal), mesh=mesh, in_specs=(spec, spec, spec),
                       out_specs=spec, axis_names=set(axes))
    return fn(q_btnh, k_bskh, v_bskh)


def _ring(q_btnh, k_bskh, v_bskh, axes, causal: bool):
    B, T, N, H = q_btnh.shape  # local block: T = global length / n
    K = k_bskh.shape[2]
    n = lax.axis_size(axes)
    i = lax.axis_index(axes)
    q_btkgh = q_btnh.reshape(B, T, K, N // K, H).astype(jnp.float32) * H**-0.5
    vary = lambda x: lax.pcast(x, axes, to="varying")  # noqa: E731
    m_btkg = vary(jnp.full((B, T, K, N // K), _NEG, jnp.float32))
    l_btkg = vary(jnp.zeros((B, T, K, N // K), jnp.float32))
    o_btkgh = vary(jnp.zeros((B, T, K, N // K, H), jnp.float32))
    q_pos = i * T + jnp.arange(T)
    perm = [(j, (j + 1) % n) for j in range(n)]

    def fold(step, k_blk, v_blk, m_btkg, l_btkg, o_btkgh):
        j = (i - step) % n  # which block of keys this device holds now; step 0 is its own (diagonal)
        s_btkgs = jnp.einsum("btkgh,bskh->btkgs", q_btkgh, k_blk.astype(jnp.float32))
        if causal:
            k_pos = j * T + jnp.arange(T)
            s_btkgs = jnp.where((k_pos[None, :] <= q_pos[:, None])[None, :, None, None, :], s_btkgs, _NEG)
        m_new = jnp.maximum(m_btkg, jnp.max(s_btkgs, axis=-1))
        p_btkgs = jnp.exp(s_btkgs - m_new[..., None])
        corr = jnp.exp(m_btkg - m_new)
        l_btkg = l_btkg * corr + jnp.sum(p_btkgs, axis=-1)
        o_btkgh = o_btkgh * corr[..., None] + jnp.einsum("btkgs,bskh->btkgh", p_btkgs, v_blk.astype(jnp.float32))
        return m_new, l_btkg, o_btkgh

    def tick(step, carry):  # fold the block held, then pass it on
        k_blk, v_blk, *acc = carry
        acc = fold(step, k_blk, v_blk, *acc)
        return *lax.ppermute((k_blk, v_blk), axes, perm), *acc

    # n - 1 passes: the last block is folded where it arrives (n passes sent 1/n more, forward and back)
    k_blk, v_blk, *acc = lax.fori_loop(0, n - 1, tick, (k_bskh, v_bskh, m_btkg, l_btkg, o_btkgh))
    _, l_btkg, o_btkgh = fold(n - 1, k_blk, v_blk, *acc)
    return (o_btkgh / l_btkg[..., None]).reshape(B, T, N, H).astype(q_btnh.dtype)
