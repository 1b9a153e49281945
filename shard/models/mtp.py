"""Multi-token prediction (DeepSeek-V3): model.mtp_depth extra modules after the decoder, run one after
another in training. Module k (0-based) at position i combines the previous module's hidden state at i
(the decoder's last, for k = 0) with the embedding of token i + k + 1, each RMS-normalised, projects the
two side by side back to the residual width (`eh_proj`), runs one layer of the decoder's kind and, through
its own final norm and the shared output head, predicts token i + k + 2. The embedding and the head are
the decoder's; the parameters are shard.config.params.mtp_params' ("mtp/...", the module first).

Their losses train the decoder's representations to plan further ahead; at inference the modules are
off (generation never runs them). They can serve speculative decoding: module k's prediction is a draft
of the token k + 2 ahead that the next decoder step verifies (DeepSeek reports 85-90% acceptance of the
second token); shard does not build that.

Letters as in shard.models.llama: B batch, T length, D embed.
"""

import jax
import jax.numpy as jnp

from shard.axes import BATCH, EMBED, RES_LENGTH
from shard.config.model import ModelConfig
from shard.models import matmuls
from shard.models.layers import norm
from shard.models.llama import compute_dtype, compute_weight, embed_tokens, run_layers
from shard.models.xent import head_nll
from shard.sharding.rules import constrain


def mtp_hidden(cfg: ModelConfig, params: dict, h_btd: jax.Array, tokens_bt: jax.Array, table=None,
               segment_ids=None, positions=None, router_bias=None) -> list[tuple[jax.Array, dict]]:
    """Each module's hidden state (B, T, D), before its final norm, and its layer's MoE statistics; `h_btd`
    the decoder's last hidden state, `tokens_bt` its input tokens (module k reads them k + 1 ahead; the
    last k + 1 positions wrap around, and their predictions are masked out by `mtp_loss`). `router_bias`:
    the model's (its rows after the main stack's layers are the modules')."""
    dtype = compute_dtype(cfg)
    out = []
    for k in range(cfg.mtp_depth):
        p = jax.tree.map(lambda a, k=k: a[k], {n: v for n, v in params["mtp"].items() if n != "layers"})
        e_btd = embed_tokens(cfg, params, jnp.roll(tokens_bt, -(k + 1), axis=1), table)  # token i + k + 1 at i
        both_btx = jnp.concatenate([norm(cfg, e_btd, p["enorm"]), norm(cfg, h_btd, p["hnorm"])], axis=-1)
        h_btd = matmuls.einsum("btx,xd->btd", both_btx, compute_weight(p["eh_proj"], (None, EMBED), dtype))
        h_btd = constrain(h_btd, (BATCH, RES_LENGTH, EMBED))
        layer = jax.tree.map(lambda a, k=k: a[k:k + 1], params["mtp"]["layers"])  # a stack of one
        bias = None if router_bias is None else router_bias[cfg.moe_layers + k:cfg.moe_layers + k + 1]
        h_btd, stats = run_layers(cfg, layer, h_btd, segment_ids=segment_ids, positions=positions, router_bias=bias,
                                  stack="mtp/layers")
        out.append((h_btd, stats))
    return out


def mtp_loss(cfg: ModelConfig, params: dict, h_btd: jax.Array, tokens_bt: jax.Array, targets_bt: jax.Array,
             mask_bt: jax.Array, table=None, segment_ids=None, positions=None,
             router_bias=None) -> tuple[jax.Array, jax.Array]:
    """(mean over modules of each module's mean next-token loss, their summed MoE auxiliary losses): module
    k's targets are `targets_bt` k + 1 positions on, counted where the mask is 1 there and, in packed rows,
    the target lies in the same document."""
    total, aux = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    T = tokens_bt.shape[1]
    modules = mtp_hidden(cfg, params, h_btd, tokens_bt, table, segment_ids, positions, router_bias)
    for k, (h_k, stats) in enumerate(modules):
        shift = k + 1
        valid_t = (jnp.arange(T) < T - shift).astype(jnp.float32)  # no wrapped-around target
        mask_k = jnp.roll(mask_bt, -shift, axis=1) * valid_t
        if segment_ids is not None:
            mask_k = mask_k * (jnp.roll(segment_ids, -shift, axis=1) == segment_ids)
        head = {**params, "final_norm": params["mtp"]["norm"][k]}
        nll, count = head_nll(cfg, head, h_k, jnp.roll(targets_bt, -shift, axis=1), mask_k, table)
        total = total + nll / jnp.maximum(count, 1.0)
        aux = aux + stats["aux"]
    return total / max(cfg.mtp_depth, 1), aux
