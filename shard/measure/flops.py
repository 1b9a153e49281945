"""FLOPs a training step computes, as XLA computes them: 6N per token for the matmuls, attention's
scores and values over the keys each query is scored against, a mixture of experts' empty capacity
slots and its dispatch, and the share of the matmuls the `[precision]` rules put in FP8. Pure functions
of the model's hyperparameters; docs/formulas.md derives them, MFU and the planner's step time read them.
"""

import math

from shard.config.model import ModelConfig
from shard.config.flops import matmul_params
from shard.config.params import model_params
from shard.config.precision import expert_weights, weight_recipes
from shard.sharding.decisions import balanced_ring


def ffn_slots(cfg: ModelConfig, seq_len: int) -> float:
    """Feed-forward rows computed per token: 1 for a dense MLP; for a mixture of experts every expert's
    capacity, filled or not, E x C per routing group (a sequence) of T tokens."""
    return cfg.n_experts * cfg.expert_capacity(seq_len) / seq_len if cfg.n_experts else 1.0


def _moe_overhead_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token that a mixture of experts computes beyond its k experts: every expert
    slot of the capacity, filled or not (E x C slots per group of T tokens, about k x capacity_factor
    per token), and the dispatch and combine einsums, which cost 2 x (E x C) x D per token each, so grow
    with the group's length. Forward and backward: 3x, but 2x for dispatch, whose 0/1 routing tensor
    takes no gradient."""
    if not cfg.n_experts:
        return 0.0
    slots = ffn_slots(cfg, seq_len)
    d, f = cfg.d_model, cfg.mlp_dim
    experts = 3 * 3 * d * f * 2 * (slots - cfg.experts_per_token)
    dispatch_and_combine = (2 + 3) * 2 * slots * seq_len * d
    return cfg.moe_layers * (experts + dispatch_and_combine)


def model_flops(cfg: ModelConfig, tokens: float, seq_len: int, context: int = 1,
                flash: bool = False) -> float:
    """Training FLOPs for `tokens` tokens as XLA computes them: 6N per token (N: parameters in matmuls)
    plus attention's QK^T and PV, forward and backward (`attention_flops`), plus a mixture of experts'
    empty slots and token dispatch. `context`: the ways the sequence is split (ring attention);
    `flash`: attention runs as a fused flash kernel (cuDNN on GPUs), which skips masked blocks."""
    return (tokens * (6 * matmul_params(cfg) + _moe_overhead_flops(cfg, seq_len))
            + attention_flops(cfg, tokens, seq_len, context, flash))


def fp8_matmul_params(cfg: ModelConfig, precision: dict[str, str]) -> float:
    """Parameters whose matmuls the `[precision]` rules put in FP8 (shard.config.precision): the forward
    and both backward matmuls of each (shard.models.fp8), 6 of `model_flops`' FLOPs per token apiece; an
    expert stack's counted at the share of experts a token runs (k / E), as `matmul_params` counts them."""
    shapes = model_params(cfg)
    experts = set(expert_weights(cfg))
    return sum(math.prod(shapes[path].shape) * (cfg.experts_per_token / cfg.n_experts if path in experts else 1)
               for path in weight_recipes(precision, cfg))


def attention_flops(cfg: ModelConfig, tokens: float, seq_len: int, context: int = 1,
                    flash: bool = False) -> float:
    """Training FLOPs of attention's QK^T and PV for `tokens` tokens, forward and backward: 12 L K N H
    per token, K the keys each query is scored against (`scored_keys`)."""
    return (tokens * 12 * cfg.n_layers * scored_keys(cfg, seq_len, context, flash)
            * cfg.n_heads * cfg.head_dim)


def scored_keys(cfg: ModelConfig, seq_len: int, context: int = 1, flash: bool = False) -> float:
    """Keys each query's scores are computed for, on average: the whole sequence (XLA's attention and
    ring attention in sequence order compute the masked half too), (2c + 1) / 4c of it for the
    load-balanced ring over c devices (three quarters of its own block, half of each other block), or
    half of it for a causal flash kernel on one device (`flash`: it skips the blocks wholly masked)."""
    if balanced_ring(cfg, seq_len, context):
        return seq_len * (2 * context + 1) / (4 * context)
    if flash and context == 1:
        return seq_len / 2
    return seq_len
