"""The output head and its next-token cross-entropy, in chunks of tokens so that only one chunk's logits
exist at a time (model.loss_chunk).

The whole logits of a step (batch x length x vocab, float32) and their gradient are the largest buffers
of a model with a large vocabulary. Chunked, the head runs inside a `lax.scan` over strided chunks of the
sequence (chunk k holds positions k, k + n, k + 2n, ...: each device keeps its own tokens whichever
mesh axes split the sequence), and its custom VJP works out the gradient in the same pass, as Liger's
fused linear cross-entropy does: the chunk's logits' gradient (softmax - one-hot) goes straight through
the head's two backward matmuls, so nothing of the chunk is kept and the head's matmul is not run again.
The weight's gradient is summed over chunks per batch shard, (P, ...) with P the batch's mesh ways, so it
is reduced across devices once after the scan, as the unchunked head's is, not once per chunk.

The sum is the same as `token_nll` on the whole logits (the same float32 logits, the same gradient
rounded to the compute dtype for the backward matmuls as `llama._logits_einsum`), added up in another
order.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from shard.axes import BATCH, EMBED, LENGTH, VOCAB
from shard.config.model import ModelConfig
from shard.models import llama, matmuls
from shard.models.attention import soft_cap
from shard.models.layers import norm
from shard.parallel.manual import varying_axes
from shard.sharding.decisions import loss_chunks
from shard.sharding.queries import auto_ways, head_vocab_split
from shard.sharding.rules import constrain

def token_nll(logits_btv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array):
    """Summed next-token cross-entropy over unmasked positions, and their count (float32).

    The target logit is picked by a gather: XLA's partitioner keeps it local on a vocab-sharded
    logits tensor (each device picks what it holds; the same collectives as a one-hot product), and it
    keeps no (B, T, V) one-hot: 31 MiB less per device for vocab 32000 at 8 x 256 tokens (fsdp=8).
    """
    logits_btv = logits_btv.astype(jnp.float32)
    logz_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    target_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
    return jnp.sum((logz_bt - target_bt) * mask_bt), jnp.sum(mask_bt)


def head_nll(cfg: ModelConfig, params: dict, x_btd: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array,
             table: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The head on the residual stream and the summed next-token loss with its token count, as
    `token_nll(llama.head_logits(...))`, in `loss_chunks` chunks of positions. Tied: through the
    compute-layout table (`table`, when given)."""
    B, T = targets_bt.shape
    n = loss_chunks(cfg, B, T, auto_ways(BATCH), auto_ways(LENGTH), auto_ways(VOCAB))
    if n <= 1:
        split = head_vocab_split(cfg, targets_bt.size, n)
        if split:  # the tokens' targets where their logits are: the batch no longer split over `split`
            targets_bt, mask_bt = (constrain(a, (BATCH, LENGTH), drop=split) for a in (targets_bt, mask_bt))
        return token_nll(llama.head_logits(cfg, params, x_btd, table, split), targets_bt, mask_bt)
    dtype = llama.compute_dtype(cfg)
    x_btd = norm(cfg, x_btd, params["final_norm"])
    if cfg.tie_embeddings:
        w = table if table is not None else llama._table(cfg, params)
        subscripts, w_axes = "btd,vd->btv", (VOCAB, EMBED)
    else:
        w = llama.compute_weight(params["unembed"], (EMBED, VOCAB), dtype)
        subscripts, w_axes = "btd,dv->btv", (EMBED, VOCAB)
    p = auto_ways(BATCH)
    p = p if B % p == 0 else 1
    return _chunked_nll(cfg, n, p, subscripts, w_axes, x_btd, w, targets_bt, mask_bt.astype(jnp.float32))


def _chunks(a: jax.Array, n: int, p: int) -> jax.Array:
    """(B, T, ...) -> (n, P, B/P, T/n, ...): chunk k holds positions k, k + n, ...; P the batch's shards."""
    B, T = a.shape[:2]
    a = a.reshape(p, B // p, T // n, n, *a.shape[2:])
    return jnp.moveaxis(a, 3, 0)


def _unchunk(a: jax.Array) -> jax.Array:
    """The inverse of `_chunks`."""
    n, p, b, t = a.shape[:4]
    return jnp.moveaxis(a, 0, 3).reshape(p * b, t * n, *a.shape[4:])


def _logits(cfg: ModelConfig, subscripts: str, x_pbtd, w):
    """A chunk's float32 logits (P, B/P, T/n, V) as the head's matmul gives them (`_finished` after)."""
    logits = jnp.einsum(subscripts.replace("btd", "pbtd").replace("btv", "pbtv"), x_pbtd, w,
                        preferred_element_type=jnp.float32)
    return constrain(logits, (BATCH, None, LENGTH, VOCAB))


def _finished(cfg: ModelConfig, logits):
    """Matmul logits soft-capped (model.final_softcap, Gemma 2) and the padded ids masked, as
    llama.head_logits finishes them."""
    return llama.mask_padded_vocab(cfg, soft_cap(logits, cfg.final_softcap))


def _scan_chunks(cfg, n, p, subscripts, w_axes, x_btd, w, targets_bt, mask_bt, grads: bool):
    xs = (constrain(_chunks(x_btd, n, p), (None, BATCH, None, LENGTH, EMBED)),
          _chunks(targets_bt, n, p), _chunks(mask_bt, n, p))
    pw = subscripts.split("->")[0].split(",")[1]  # "vd" or "dv"
    dw_axes = (BATCH, *w_axes)

    def body(carry, chunk):
        nll, dw = carry
        x_pbtd, t_pbt, m_pbt = chunk
        x_pbtd = constrain(x_pbtd, (BATCH, None, LENGTH, EMBED))
        if not grads:
            nll_c, _ = token_nll(_finished(cfg, _logits(cfg, subscripts, x_pbtd, w)), t_pbt, m_pbt)
            return (nll + nll_c, dw), None
        nll_c, pull_logits = jax.vjp(lambda lg: token_nll(_finished(cfg, lg), t_pbt, m_pbt)[0],
                                     _logits(cfg, subscripts, x_pbtd, w))
        (g_pbtv,) = pull_logits(jnp.ones_like(nll_c))
        g_pbtv = g_pbtv.astype(jnp.result_type(x_pbtd, w))  # as llama._logits_einsum's backward
        dx_pbtd = matmuls.rounded_einsum(f"pbtv,{pw}->pbtd", g_pbtv, w)
        # per batch shard: summed across devices once, after the scan
        dw_c = jnp.einsum(f"pbtd,pbtv->p{pw}", x_pbtd, g_pbtv, preferred_element_type=jnp.float32)
        dw = constrain(dw + dw_c, dw_axes)
        return (nll + nll_c, dw), constrain(dx_pbtd, (BATCH, None, LENGTH, EMBED))

    dw0 = constrain(jnp.zeros((p, *w.shape), jnp.float32), dw_axes) if grads else jnp.zeros((), jnp.float32)
    carry = _varying((jnp.zeros((), jnp.float32), dw0), x_btd, w, mask_bt)
    (nll, dw), dx = jax.lax.scan(body, carry, xs)
    if not grads:
        return nll
    dx_btd = constrain(_unchunk(dx), (BATCH, LENGTH, EMBED)).astype(x_btd.dtype)
    return nll, dx_btd, constrain(jnp.sum(dw, axis=0), w_axes)


def _varying(carry, *inputs):
    """Fresh loop carries varying over the manual mesh axes the inputs vary over (inside the pipeline's
    shard_map), as the loop's body makes them."""
    axes = set().union(*map(varying_axes, inputs))
    return jax.lax.pcast(carry, tuple(sorted(axes)), to="varying") if axes else carry


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _chunked_nll(cfg, n, p, subscripts, w_axes, x_btd, w, targets_bt, mask_bt):
    nll = _scan_chunks(cfg, n, p, subscripts, w_axes, x_btd, w, targets_bt, mask_bt, grads=False)
    return nll, jnp.sum(mask_bt)


def _chunked_nll_fwd(cfg, n, p, subscripts, w_axes, x_btd, w, targets_bt, mask_bt):
    nll, dx_btd, dw = _scan_chunks(cfg, n, p, subscripts, w_axes, x_btd, w, targets_bt, mask_bt, grads=True)
    # w's dtype rides along as an empty array (residuals are arrays)
    return (nll, jnp.sum(mask_bt)), (dx_btd, dw, jnp.zeros((0,), w.dtype), targets_bt, mask_bt)


def _chunked_nll_bwd(cfg, n, p, subscripts, w_axes, res, cotangents):
    dx_btd, dw, w_like, targets_bt, mask_bt = res
    g = cotangents[0]  # the token count has no gradient
    return (dx_btd * g.astype(dx_btd.dtype), (dw * g).astype(w_like.dtype),
            np.zeros(targets_bt.shape, jax.dtypes.float0), jnp.zeros_like(mask_bt))


_chunked_nll.defvjp(_chunked_nll_fwd, _chunked_nll_bwd)
