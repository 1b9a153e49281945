"""The FLOPs per token a model config's training step does, from its hyperparameters alone: the
matmul parameters (6N), MFU's count (useful work: causal attention at half, windows as attended) and the
hardware FLOP share's (the whole score square and what remat recomputes). Pure data, no JAX.
"""

import math

from shard.config.model import ModelConfig
from shard.config.params import dense_layer_params


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (norms, biases and a lookup-only table do not); of a
    mixture of experts, the router and the k experts a token is routed to."""
    # num_params leaves out the padded vocab rows: the head's are masked, not useful work
    n = cfg.num_params() - cfg.d_model * (2 * cfg.n_layers + 1)
    features = [p for p in dense_layer_params(cfg).values() if p.feature]  # biases and norm scales
    n -= cfg.n_layers * sum(math.prod(p.shape) for p in features)
    if not cfg.tie_embeddings:
        n -= cfg.vocab_size * cfg.d_model  # the input table is a lookup; unembed is the matmul
    if cfg.n_experts:
        n -= cfg.moe_layers * 3 * cfg.d_model * cfg.mlp_dim * (cfg.n_experts - cfg.experts_per_token)
    if cfg.mtp_depth:  # each module's five norms and its layer's features, its idle experts; the shared head
        n -= cfg.mtp_depth * (5 * cfg.d_model + sum(math.prod(p.shape) for p in features))
        n += cfg.mtp_depth * cfg.vocab_size * cfg.d_model  # runs once more per module
        n -= cfg.mtp_depth * 3 * cfg.d_model * cfg.mlp_dim * max(cfg.n_experts - cfg.experts_per_token, 0)
    return n


def mfu_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The one MFU definition shard reports: 6N per token (N: parameters in matmuls, with a mixture of
    experts' k routed experts, not all of them) plus causal attention counted at half, 6 L T N H per
    token (QK^T and PV, forward and backward, over the lower triangle only). A layer with a window W
    shorter than the sequence counts the keys its queries see on average, W - W^2 / 2T, in place of
    T / 2 (attended_keys). Recomputation by remat, and a mixture of experts' capacity slack and
    dispatch, are not counted: MFU measures useful work."""
    keys = sum(attended_keys(seq_len, w) for w in cfg.layer_windows())
    return 6 * matmul_params(cfg) + 6 * keys * cfg.n_heads * (cfg.head_dim + cfg.v_dim)


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, platform: str) -> float:
    """The matmul FLOPs per token a training step runs (the hardware FLOP share's count): 6N as MFU counts
    it, attention over the whole score square (XLA's attention computes every score and masks the
    future), and what remat recomputes. Full remat runs each layer's forward again for its backward,
    but not the matmuls whose outputs the backward does not read (the attention output and the MLP's
    down projection: their inputs are what their gradients need). dots and dots_no_batch keep the
    projections' outputs; on XLA:CPU their compiled step recomputes no matmul (measured: +0.2% FLOPs).
    Elementwise FLOPs (norms, softmax, the optimizer) are not counted: they do not run on the matmul
    units the peak measures (a few % of the compiled HLO's count at d_model 256)."""
    heads = cfg.n_heads * (cfg.head_dim + cfg.v_dim)  # QK^T and PV per key
    flops = 6 * matmul_params(cfg) + 6 * seq_len * heads * cfg.n_layers
    if cfg.remat_on(platform) == "full":
        downs = (cfg.experts_per_token if cfg.n_experts else 1) + cfg.n_shared_experts  # a MoE: approximate
        not_read = cfg.n_heads * cfg.v_dim * cfg.d_model + downs * cfg.mlp_dim * cfg.d_model
        layer = (matmul_params(cfg) - cfg.vocab_size * cfg.d_model) / cfg.n_layers
        flops += cfg.n_layers * (2 * (layer - not_read) + 2 * seq_len * heads)
    return flops


def attended_keys(seq_len: int, window: int) -> float:
    """The keys a query attends to on average over a sequence, as MFU counts them: T / 2 (causal), or
    with a window W < T (0: none), W - W^2 / 2T (the first W queries see fewer)."""
    if not window or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)
