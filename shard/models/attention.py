"""The decoder's attention (shard.models.llama): causal grouped-query attention by backend (cuDNN's flash
attention, XLA's, the einsum version that checks them, or ring attention where the layout splits `length`),
with the queries in chunks (model.attention_chunk); whether cuDNN's applies to a trace (`_cudnn_problem`); and
the KV cache's attention of new tokens over the whole cache or a rolling one of the window.

Dimension letters as in shard.models.llama: B batch, T the queries' length, S the keys', N heads, K kv_heads,
G = N/K query heads per kv head, H head_dim.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp

from shard.axes import BATCH, HEAD_DIM, HEADS, LENGTH
from shard.errors import ShardError
from shard.parallel.ring_attention import context_axes, ring_attention
from shard.sharding.decisions import attention_backend, attention_chunks, cudnn_attention_problem
from shard.sharding.queries import auto_ways, queries_split_like_keys
from shard.sharding.rules import constrain


def causal_attention(q_btnh, k_bskh, v_bskh, impl: str, zigzag: bool = False, segment_ids=None, window=0,
                     scale: float | None = None, softcap: float = 0.0, chunk: int = 0):
    """Causal grouped-query attention. `impl` is model.attention: "cudnn" is cuDNN's flash attention and
    "xla" XLA's attention, both through jax.nn.dot_product_attention; "auto" is cuDNN's where it applies
    (shard.sharding.decisions.attention_backend), XLA's otherwise; "reference" is the plain einsum
    version that checks them. When the layout splits `length` over mesh axes (context parallel), ring
    attention runs instead, load-balanced where the sequence comes in its zig-zag order (`zigzag`).

    `segment_ids` (B, T): packed rows; a query attends only to keys of its own segment. XLA's attention
    takes that as a (B, 1, T, T) mask. cuDNN is not used for them: jax.nn.dot_product_attention hands
    cuDNN a mask only as a dense bias (a (B, 1, T, T) tensor read by the kernel, and the bias variant of
    it), which gives up the O(T) memory flash attention is chosen for; cuDNN's own packed layout
    (per-row segment offsets and lengths, `q_offsets`/`kv_offsets`) is reachable only through the private
    jax._src.cudnn API, needs Hopper and a static bound on documents per row, and cannot be checked
    without a GPU. So "auto" runs XLA's attention for packed rows and "cudnn" by name is an error.

    `window` > 0 (model.sliding_window): a query at position t attends to keys at t - window + 1 .. t
    only. XLA's and cuDNN's attention take it as `local_window_size=(window - 1, 0)` (JAX: t - s <=
    left; cuDNN gets `left + 1` with an exclusive bound); ring attention has no window and refuses.

    `scale`: the scores' factor (None: head_dim ** -0.5). A window that differs by layer (a traced
    `window`, Gemma's local and global layers) or soft-capped scores (`softcap`, Gemma 2) run the
    einsum version, which takes both (jax.nn.dot_product_attention takes neither); so does "cudnn"
    by name refuse them.

    `chunk` (model.attention_chunk: queries per chunk, -1 auto, 0 off): XLA's attention and the einsum
    version take the queries in chunks (`query_chunked`), so one chunk's scores exist at a time; cuDNN's
    and ring attention hold no scores, and "reference" runs whole."""
    special = isinstance(window, jax.Array) or softcap
    if axes := context_axes():
        what = ("model.attn_softcap" if softcap else "a window of some layers (model.global_every)"
                if isinstance(window, jax.Array) else f"model.sliding_window={window}" if window else "")
        if what:
            raise ShardError(f"{what} can't run with context parallelism (`length` split over {'x'.join(axes)}): "
                             "ring attention has no sliding window or soft-capping; split the batch instead")
        if impl == "cudnn":  # asked for by name: say it can't run, as everywhere else it can't
            raise ShardError("model.attention=cudnn can't run here: context parallelism (`length` split over "
                             f"{'x'.join(axes)}) uses ring attention; use auto")
        if scale is not None and scale != q_btnh.shape[-1] ** -0.5:
            raise ShardError("model.query_scale can't run with context parallelism: ring attention scales by "
                             "head_dim ** -0.5; split the batch instead")
        if segment_ids is not None:
            return ring_attention(q_btnh, k_bskh, v_bskh, axes, causal=True, zigzag=zigzag, segment_ids=segment_ids)
        return ring_attention(q_btnh, k_bskh, v_bskh, axes, causal=True, zigzag=zigzag)
    if special:
        if impl == "cudnn":
            raise ShardError("model.attention=cudnn can't run here: soft-capped scores or windows that differ by "
                             "layer (Gemma) run the einsum attention; use auto")
        return query_chunked(lambda q, at, seg_q: cached_attention(q, k_bskh, v_bskh, at, seg_q, window, scale,
                                                                   softcap, key_segment_ids=segment_ids),
                             q_btnh, segment_ids, _query_chunks(q_btnh, chunk))
    if impl in ("auto", "cudnn"):
        problem = _cudnn_problem(q_btnh, segments=segment_ids is not None)
        if impl == "cudnn" and problem:
            raise ShardError(f"model.attention=cudnn can't run here: {problem}; use auto or xla")
        impl = attention_backend(impl, problem)
    if impl == "xla" and (n := _query_chunks(q_btnh, chunk)) > 1:
        return query_chunked(lambda q, at, seg_q: _xla_attention_at(q, k_bskh, v_bskh, at, seg_q, segment_ids,
                                                                    window, scale), q_btnh, segment_ids, n)
    if impl in ("cudnn", "xla"):
        local = (window - 1, 0) if window else None
        if segment_ids is not None:
            same_bts = segment_ids[:, :, None] == segment_ids[:, None, :]
            return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=same_bts[:, None], scale=scale,
                                                is_causal=True, local_window_size=local, implementation=impl)
        return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, scale=scale, is_causal=True,
                                            local_window_size=local, implementation=impl)
    return cached_attention(q_btnh, k_bskh, v_bskh, 0, segment_ids, window, scale)


def _query_chunks(q_btnh, chunk: int) -> int:
    """attention_chunks for these queries under the active layout (rows and heads per device)."""
    B, T, N, _ = q_btnh.shape
    return attention_chunks(chunk, T, max(B // auto_ways(BATCH), 1), max(N // auto_ways(HEADS), 1))


def query_chunked(attend, q_btnh, segment_ids, n: int):
    """attend(q, start, seg_q) over `n` contiguous chunks of the queries, one after another: chunk i is
    q (B, T/n, N, H) at positions start = i T/n.., with its segment ids seg_q (B, T/n) (None without
    packed rows), and attends to all the keys, its softmax exact. Each chunk is recomputed in the
    backward pass (jax.checkpoint), so the forward and the backward hold one chunk's scores at a time,
    not (B, N, T, T) of them; the price is the scores' matmul and softmax once more. n = 1: attend itself."""
    if n <= 1:
        return attend(q_btnh, 0, segment_ids)
    B, T, N, H = q_btnh.shape
    c = T // n
    q_nbtnh = jnp.moveaxis(q_btnh.reshape(B, n, c, N, H), 1, 0)  # (chunks, batch, T/n, heads, head_dim)
    seg_nbt = None if segment_ids is None else jnp.moveaxis(segment_ids.reshape(B, n, c), 1, 0)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one(xs):
        i, q, seg_q = xs
        q = constrain(q, (BATCH, LENGTH, HEADS, HEAD_DIM))
        return constrain(attend(q, i * c, seg_q), (BATCH, LENGTH, HEADS, HEAD_DIM))

    o_nbtnh = jax.lax.map(one, (jnp.arange(n), q_nbtnh, seg_nbt))
    return jnp.moveaxis(o_nbtnh, 0, 1).reshape(B, T, N, H)


def _xla_attention_at(q_btnh, k_bskh, v_bskh, start, seg_q, segment_ids, window, scale):
    """XLA's attention (jax.nn.dot_product_attention) of queries at positions start.. over keys at
    0..S-1: causal, within `window` (0: none) and, with packed rows, the query's own segment (`seg_q` of
    the queries, `segment_ids` of the keys), as one boolean mask; the same scores, softmax and masked
    value as its is_causal and local_window_size give the whole sequence."""
    back_ts = (start + jnp.arange(q_btnh.shape[1]))[:, None] - jnp.arange(k_bskh.shape[1])[None, :]
    allowed_ts = (back_ts >= 0) & (back_ts < window) if window else back_ts >= 0
    mask = allowed_ts[None, None]  # (1, 1, T, S)
    if seg_q is not None:
        mask = mask & (seg_q[:, :, None] == segment_ids[:, None, :])[:, None]  # (B, 1, T, S)
    return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=mask, scale=scale, implementation="xla")


def _cudnn_problem(q_btnh, segments: bool = False) -> str:
    """cudnn_attention_problem for this trace: the backend JAX runs on, the inputs' dtype and head dim,
    the active layout's split of queries against keys, and whether the rows are packed (`segments`)."""
    backend = jax.extend.backend.get_backend()
    platform = "cuda" if backend.platform == "gpu" and "cuda" in backend.platform_version.lower() else backend.platform
    same_split = queries_split_like_keys()
    manual = bool(jax.sharding.get_abstract_mesh().manual_axes)
    return cudnn_attention_problem(platform=platform, dtype=jnp.dtype(q_btnh.dtype).name,
                                   head_dim=q_btnh.shape[-1], same_split=same_split, manual=manual,
                                   segments=segments)


def rolling_cache(kv: dict, window) -> bool:
    """Whether a layer's cache slice is init_cache's rolling one: as long as its (static) window."""
    return isinstance(window, int) and window > 0 and kv["k"].shape[1] == window


def rolling_attention(q_btnh, k_btkh, v_btkh, kv: dict, start, window: int, scale, softcap: float):
    """Attention of T new tokens at positions start.. over a rolling cache of the last `window` positions
    (slot j holds the latest position before start that is j modulo the window) and over themselves;
    then the last min(T, window) of them written into their slots. Returns (output, updated cache)."""
    W, T = kv["k"].shape[1], q_btnh.shape[1]
    slots = jnp.arange(W)
    held_s = start - 1 - jnp.mod(start - 1 - slots, W)  # negative: a slot not written yet
    key_pos = jnp.concatenate([jnp.where(held_s >= 0, held_s, -(2**30)), start + jnp.arange(T)])
    k_bskh = jnp.concatenate([kv["k"], k_btkh.astype(kv["k"].dtype)], axis=1)
    v_bskh = jnp.concatenate([kv["v"], v_btkh.astype(kv["v"].dtype)], axis=1)
    o_btnh = cached_attention(q_btnh, k_bskh, v_bskh, start, window=window, scale=scale, softcap=softcap,
                              key_positions=key_pos)
    n = min(T, W)  # the newest n: older ones of a long prompt fall out of the window anyway
    idx = jnp.mod(start + T - n + jnp.arange(n), W)
    kv = {"k": kv["k"].at[:, idx].set(k_btkh[:, T - n:].astype(kv["k"].dtype)),
          "v": kv["v"].at[:, idx].set(v_btkh[:, T - n:].astype(kv["v"].dtype))}
    return o_btnh, kv


def cached_attention(q_btnh, k_bskh, v_bskh, start, segment_ids=None, window=0, scale: float | None = None,
                     softcap: float = 0.0, key_positions=None, key_segment_ids=None):
    """Grouped-query attention of queries at positions start.. over keys at positions 0..S-1, causal.
    `segment_ids` (B, T), self-attention of packed rows only (start 0, S = T): keys of the query's
    own segment only. `window` > 0: keys less than `window` positions back only (the KV cache keeps
    every position and masks the older ones: it is not cut to the window); a traced window of 0 is
    none. `scale`: the scores' factor (None: head_dim ** -0.5); `softcap` > 0: scores soft-capped
    (soft_cap) before the mask. `key_positions` (S,): the keys' positions where they are not 0..S-1
    (a rolling cache's). `key_segment_ids` (B, S): the keys' segments where the queries are a chunk of
    the row (`query_chunked`); None: `segment_ids`."""
    B, T, N, H = q_btnh.shape
    K = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(B, T, K, N // K, H)
    scale = H**-0.5 if scale is None else scale
    scores_bkgts = soft_cap(jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh).astype(jnp.float32) * scale, softcap)
    key_s = jnp.arange(k_bskh.shape[1]) if key_positions is None else key_positions
    back_ts = (start + jnp.arange(T))[:, None] - key_s[None, :]
    if isinstance(window, jax.Array):
        causal_ts = (back_ts >= 0) & ((window == 0) | (back_ts < window))
    else:
        causal_ts = (back_ts >= 0) & (back_ts < window) if window else back_ts >= 0
    if segment_ids is not None:  # and the same segment: (B, 1, 1, T, S)
        same_bts = segment_ids[:, :, None] == (segment_ids if key_segment_ids is None else key_segment_ids)[:, None, :]
        scores_bkgts = jnp.where(causal_ts & same_bts[:, None, None], scores_bkgts, jnp.finfo(jnp.float32).min)
    else:
        scores_bkgts = jnp.where(causal_ts, scores_bkgts, jnp.finfo(jnp.float32).min)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(v_bskh.dtype)
    o_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs_bkgts, v_bskh)
    return o_btkgh.reshape(B, T, N, H)


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's soft-capping of attention scores and logits); x itself for cap 0."""
    return cap * jnp.tanh(x / cap) if cap else x


def max_logits(q_btnh, k_bskh, scale: float | None = None, window=0, segment_ids=None, chunk: int = 0) -> jax.Array:
    """The largest attention logit (scaled score, before the softmax) of each query head over the positions
    causal attention lets it see (within `window`, within its segment): (N,) float32, for MuonClip's QK-clip
    (optimizer.qk_clip). No gradient; the flash kernels keep no scores, so this is one more QK^T matmul
    (a sixth of attention's FLOPs with its backward) and a max, the queries in chunks as the attention takes
    them (`chunk`: model.attention_chunk), so one chunk's scores exist at a time."""
    q_btnh, k_bskh = jax.lax.stop_gradient(q_btnh), jax.lax.stop_gradient(k_bskh)
    B, T, N, H = q_btnh.shape
    K = k_bskh.shape[2]
    scale = H**-0.5 if scale is None else scale

    def chunk_max(start, q, seg_q):  # queries (B, C, N, H) at positions start.. -> (N,)
        q_btkgh = q.reshape(B, q.shape[1], K, N // K, H)
        scores_bkgts = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh).astype(jnp.float32) * scale
        back_ts = (start + jnp.arange(q.shape[1]))[:, None] - jnp.arange(k_bskh.shape[1])[None, :]
        if isinstance(window, jax.Array):
            seen = (back_ts >= 0) & ((window == 0) | (back_ts < window))
        else:
            seen = (back_ts >= 0) & (back_ts < window) if window else back_ts >= 0
        seen = seen[None, None, None]  # (1, 1, 1, T, S)
        if seg_q is not None:  # and the query's own segment
            seen = seen & (seg_q[:, :, None] == segment_ids[:, None, :])[:, None, None]
        return jnp.max(jnp.where(seen, scores_bkgts, -jnp.inf), axis=(0, 3, 4)).reshape(N)

    n = _query_chunks(q_btnh, chunk)
    if n <= 1:
        return chunk_max(0, q_btnh, segment_ids)
    c = T // n
    q_nbtnh = jnp.moveaxis(q_btnh.reshape(B, n, c, N, H), 1, 0)  # (chunks, batch, T/n, heads, head_dim)
    seg_nbt = None if segment_ids is None else jnp.moveaxis(segment_ids.reshape(B, n, c), 1, 0)
    tops_nn = jax.lax.map(lambda xs: chunk_max(xs[0] * c, xs[1], xs[2]), (jnp.arange(n), q_nbtnh, seg_nbt))
    return jnp.max(tops_nn, axis=0)
