"""Ring attention for context parallelism: queries stay put, key/value blocks travel round a ring.

With the sequence split into n blocks over the mesh axes that `length` maps to, each device holds one
query block and, over n ticks, sees every key/value block (passed to its neighbour by ppermute),
folding each into an online softmax (flash-attention style). Memory per device is O(T/n).

Causal attention in the sequence's own order leaves the work unbalanced: the device holding the first
block needs one block of keys, the last device all n. Training therefore lays the sequence out
zig-zag (`zigzag_positions`): cut into 2n chunks, device i holds chunks i and 2n-1-i, an early one and
a late one. Then, after its own block, every device folds exactly half of each block it receives:
from a device before it in the ring, its queries attend to that block's early chunk only; from a
device after it, only its late chunk's queries attend, to the whole block. Every device does the same
work, (2n + 1) / 4n of the full grid of chunk pairs (its own block: three pairs of four) instead of all
of it, and the ring moves the same bytes (MaxText calls this load-balanced context parallelism).

Packed rows (several documents per row): the segment ids of each key/value block travel round the ring
with it, and every fold masks keys of another segment on top of the causal mask. A fold that masks all
of its keys for a query leaves garbage in that query's running sum only until a real score arrives
(the running max then scales it by exp(-1e30) = 0), and every query scores at least itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from shard.axes import LENGTH
from shard.sharding.rules import active_layout

_NEG = -1e30  # finite "minus infinity": a fully masked block must not produce inf - inf


def context_axes() -> tuple[str, ...]:
    """Mesh axes that split the sequence in the layout being traced (empty when not context parallel)."""
    layout = active_layout()
    return () if layout is None else layout.mesh_axes(LENGTH)


def zigzag_positions(seq_len: int, n: int) -> np.ndarray | None:
    """The sequence positions in the load-balanced order for n devices (each holds chunks i and
    2n-1-i of 2n), or None where the length does not cut into 2n chunks."""
    if n < 2 or seq_len % (2 * n):
        return None
    chunks = np.arange(seq_len).reshape(2 * n, seq_len // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def ring_attention(q_btnh, k_bskh, v_bskh, axes: tuple[str, ...], *, causal: bool = True, zigzag: bool = False,
                   mesh=None, segment_ids=None):
    """Grouped-query attention with the length dim split over `axes`; equals full attention. With
    `zigzag` (causal only), the inputs are in `zigzag_positions` order and so is the output.
    `segment_ids` (B, T), in the same order: queries attend to keys of their own segment only."""
    if mesh is None:
        mesh = active_layout().mesh
    if zigzag and not causal:
        raise ValueError("the zig-zag order balances causal attention only")
    spec = P(None, axes if len(axes) > 1 else axes[0])
    ring = _zigzag_ring if zigzag else _ring
    if segment_ids is not None:
        fn = jax.shard_map(lambda q, k, v, seg: ring(q, k, v, axes, causal, seg), mesh=mesh,
                           in_specs=(spec, spec, spec, spec), out_specs=spec, axis_names=set(axes))
        return fn(q_btnh, k_bskh, v_bskh, segment_ids)
    fn = jax.shard_map(lambda q, k, v: ring(q, k, v, axes, causal), mesh=mesh, in_specs=(spec, spec, spec),
                       out_specs=spec, axis_names=set(axes))
    return fn(q_btnh, k_bskh, v_bskh)


def _same_segment(seg_q_bt, seg_k_bs, mask_ts=None):
    """(B, T, S): keys of each query's own segment, where `mask_ts` (T, S) allows them too, if given."""
    same_bts = seg_q_bt[:, :, None] == seg_k_bs[:, None, :]
    return same_bts if mask_ts is None else same_bts & mask_ts[None]


def _fold(q_btkgh, k_bskh, v_bskh, acc, mask_ts=None):
    """One block of keys folded into the online softmax's (running max, sum, output) of these queries.
    As in flash attention, the two matmuls take their inputs in the compute dtype (bf16 on GPUs: the
    tensor cores' full rate, where float32 inputs ran as TF32 at about half) and accumulate in float32;
    the softmax's statistics and the output stay float32. `mask_ts`: (T, S), or (B, T, S) per row."""
    m_btkg, l_btkg, o_btkgh = acc
    s_btkgs = jnp.einsum("btkgh,bskh->btkgs", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    if mask_ts is not None and mask_ts.ndim == 3:
        s_btkgs = jnp.where(mask_ts[:, :, None, None, :], s_btkgs, _NEG)
    elif mask_ts is not None:
        s_btkgs = jnp.where(mask_ts[None, :, None, None, :], s_btkgs, _NEG)
    m_new = jnp.maximum(m_btkg, jnp.max(s_btkgs, axis=-1))
    p_btkgs = jnp.exp(s_btkgs - m_new[..., None])
    corr = jnp.exp(m_btkg - m_new)
    l_btkg = l_btkg * corr + jnp.sum(p_btkgs, axis=-1)
    pv_btkgh = jnp.einsum("btkgs,bskh->btkgh", p_btkgs.astype(v_bskh.dtype), v_bskh, preferred_element_type=jnp.float32)
    o_btkgh = o_btkgh * corr[..., None] + pv_btkgh
    return m_new, l_btkg, o_btkgh


def _start(q_btnh, K, axes):
    """Scaled queries grouped by kv head (in their own dtype), and an empty float32 accumulator,
    varying over the ring."""
    B, T, N, H = q_btnh.shape
    q_btkgh = (q_btnh.reshape(B, T, K, N // K, H).astype(jnp.float32) * H**-0.5).astype(q_btnh.dtype)
    vary = lambda x: lax.pcast(x, axes, to="varying")  # noqa: E731
    acc = (vary(jnp.full((B, T, K, N // K), _NEG, jnp.float32)), vary(jnp.zeros((B, T, K, N // K), jnp.float32)),
           vary(jnp.zeros((B, T, K, N // K, H), jnp.float32)))
    return q_btkgh, acc


def _finish(acc, q_btnh):
    _, l_btkg, o_btkgh = acc
    return (o_btkgh / l_btkg[..., None]).reshape(q_btnh.shape).astype(q_btnh.dtype)


def _ring(q_btnh, k_bskh, v_bskh, axes, causal: bool, seg_bt=None):
    """Blocks in sequence order: the block arriving at each tick is folded whole, masked by position
    (packed rows: `_packed_ring`)."""
    if seg_bt is not None:
        return _packed_ring(q_btnh, k_bskh, v_bskh, axes, causal, seg_bt)
    T = q_btnh.shape[1]  # local block: T = global length / n
    n = lax.axis_size(axes)
    i = lax.axis_index(axes)
    q_btkgh, acc = _start(q_btnh, k_bskh.shape[2], axes)
    q_pos = i * T + jnp.arange(T)
    perm = [(j, (j + 1) % n) for j in range(n)]

    def fold(step, k_blk, v_blk, acc):
        j = (i - step) % n  # which block of keys this device holds now; step 0 is its own (diagonal)
        mask = (j * T + jnp.arange(T))[None, :] <= q_pos[:, None] if causal else None
        return _fold(q_btkgh, k_blk, v_blk, acc, mask)

    def tick(step, carry):  # fold the block held, then pass it on
        k_blk, v_blk, acc = carry
        return *lax.ppermute((k_blk, v_blk), axes, perm), fold(step, k_blk, v_blk, acc)

    # n - 1 passes: the last block is folded where it arrives (n passes sent 1/n more, forward and back)
    k_blk, v_blk, acc = lax.fori_loop(0, n - 1, tick, (k_bskh, v_bskh, acc))
    return _finish(fold(n - 1, k_blk, v_blk, acc), q_btnh)


def _packed_ring(q_btnh, k_bskh, v_bskh, axes, causal: bool, seg_bt):
    """`_ring` for packed rows: each block's segment ids (`seg_bt`: this device's) travel with its keys
    and values, and each fold also masks keys of another segment."""
    T = q_btnh.shape[1]
    n = lax.axis_size(axes)
    i = lax.axis_index(axes)
    q_btkgh, acc = _start(q_btnh, k_bskh.shape[2], axes)
    q_pos = i * T + jnp.arange(T)
    perm = [(j, (j + 1) % n) for j in range(n)]

    def fold(step, k_blk, v_blk, seg_blk, acc):
        j = (i - step) % n
        causal_ts = (j * T + jnp.arange(T))[None, :] <= q_pos[:, None] if causal else None
        return _fold(q_btkgh, k_blk, v_blk, acc, _same_segment(seg_bt, seg_blk, causal_ts))

    def tick(step, carry):
        k_blk, v_blk, seg_blk, acc = carry
        return *lax.ppermute((k_blk, v_blk, seg_blk), axes, perm), fold(step, k_blk, v_blk, seg_blk, acc)

    k_blk, v_blk, seg_blk, acc = lax.fori_loop(0, n - 1, tick, (k_bskh, v_bskh, seg_bt, acc))
    return _finish(fold(n - 1, k_blk, v_blk, seg_blk, acc), q_btnh)


def _zigzag_ring(q_btnh, k_bskh, v_bskh, axes, causal: bool, seg_bt=None):
    """Blocks in zig-zag order (chunks i and 2n-1-i of 2n on device i): of the own block the three chunk
    pairs not wholly masked, of every other block half, unmasked (see the module docstring).

    Half a block is two chunk pairs, and one of them is the same either way: the late queries against
    the early keys. The other is the early queries against the early keys (a block from before) or the
    late queries against the late keys (from after), chosen by `where`, not `cond`: autodiff through a
    `cond` keeps both branches' residuals. Each pair is folded into its queries' running state in turn,
    so a tick keeps one chunk's worth of state per pair for the backward pass, as the plain ring keeps
    one block's (merging separately folded pairs kept three times as much)."""
    T = q_btnh.shape[1]
    h = T // 2  # one chunk
    n = lax.axis_size(axes)
    i = lax.axis_index(axes)
    q_btkgh, acc = _start(q_btnh, k_bskh.shape[2], axes)
    early, late = (tuple(a[:, :h] for a in acc), tuple(a[:, h:] for a in acc))
    q_early, q_late = q_btkgh[:, :h], q_btkgh[:, h:]
    packed = seg_bt is not None  # packed rows: the keys' segment ids travel with them (`blk`)
    halves = lambda seg: (seg[:, :h], seg[:, h:]) if packed else (None, None)  # noqa: E731
    mask = lambda sq, sk, causal=None: _same_segment(sq, sk, causal) if packed else causal  # noqa: E731
    s_early, s_late = halves(seg_bt)
    # the own block: three of its four chunk pairs (the early queries precede the late keys)
    causal = jnp.arange(h)[None, :] <= jnp.arange(h)[:, None]
    early = _fold(q_early, k_bskh[:, :h], v_bskh[:, :h], early, mask(s_early, s_early, causal))
    late = _fold(q_late, k_bskh[:, :h], v_bskh[:, :h], late, mask(s_late, s_early))
    late = _fold(q_late, k_bskh[:, h:], v_bskh[:, h:], late, mask(s_late, s_late, causal))
    perm = [(j, (j + 1) % n) for j in range(n)]

    def tick(step, carry):  # receive the next block, fold its half that counts
        blk, early, late = carry
        blk = lax.ppermute(blk, axes, perm)
        k_blk, v_blk = blk[:2]
        sk_early, sk_late = halves(blk[2]) if packed else (None, None)
        before = (i - step) % n < i  # the block comes from a device before this one
        pick = lambda a, b: jnp.where(before, a, b)  # noqa: E731
        late = _fold(q_late, k_blk[:, :h], v_blk[:, :h], late, mask(s_late, sk_early))  # the pair either way
        into = tuple(map(pick, early, late))
        got = _fold(pick(q_early, q_late), pick(k_blk[:, :h], k_blk[:, h:]), pick(v_blk[:, :h], v_blk[:, h:]), into,
                    mask(pick(s_early, s_late), pick(sk_early, sk_late)) if packed else None)
        return blk, tuple(map(pick, got, early)), tuple(map(pick, late, got))

    blk = (k_bskh, v_bskh, seg_bt) if packed else (k_bskh, v_bskh)
    _, early, late = lax.fori_loop(1, n, tick, (blk, early, late))
    return _finish(tuple(jnp.concatenate(pair, axis=1) for pair in zip(early, late)), q_btnh)
