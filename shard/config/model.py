"""Model hyperparameters (ModelConfig) and what follows from them alone: their parameters' shapes and
counts (from shard.config.params' tables); MFU's FLOPs are shard.config.flops', the named presets
shard.config.presets'.
Pure data: importing this never imports JAX."""

import dataclasses
import functools
import math
from dataclasses import dataclass

from shard.config.params import model_params

REMAT_POLICIES = ("auto", "none", "full", "dots", "dots_no_batch")
ATTENTION_IMPLS = ("auto", "cudnn", "xla", "reference")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
MOE_ROUTINGS = ("capacity", "dropless")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_SCALINGS = ("llama3", "yarn", "linear")
ROUTER_SCORES = ("softmax", "sigmoid")
# The stored embedding and unembedding tables round their vocab dim up to a multiple of this, whatever
# the mesh, so a vocabulary no split divides (GPT-2's 50257) runs on any mesh whose vocab split divides
# 128, and a checkpoint restores on every such mesh (ModelConfig.padded_vocab).
VOCAB_MULTIPLE = 128


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (its paper's Eq. 21, transformers' yarn_get_mscale): 0.1 mscale
    ln(factor) + 1, 1 for a factor of 1 or less. With MLA, DeepSeek-V3 also multiplies the softmax scale
    by yarn_mscale(factor, mscale_all_dim) squared (transformers' yarn_apply_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _cpu_bf16() -> bool:
    from shard.hardware import cpu_has_bf16_matmul  # reads /proc/cpuinfo once

    return cpu_has_bf16_matmul()


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, scanned layers; model
    families (Qwen2, Qwen3, Mistral, Mixtral) are features of it (docs/models.md)."""

    name: str = "small"
    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 32
    mlp_dim: int = 768
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    # RoPE scaling by a factor rope_scaling (0: plain RoPE), of the kind rope_scaling_type (docs/models.md):
    # "llama3" (Llama 3.1 and 3.2): the low frequencies divided by the factor, the high ones kept, those
    # between blended; "yarn" (YaRN: DeepSeek-V3, Qwen's long context): the same with the blend over the
    # dims whose rotations in rope_original_context lie between rope_beta_slow and rope_beta_fast, and
    # cos and sin times the attention factor; "linear" (Gemma 3's global layers): every frequency divided.
    rope_scaling: float = 0.0
    rope_scaling_type: str = "llama3"
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    # YaRN's attention factor on cos and sin: rope_attention_factor where set, else mscale(rope_mscale) /
    # mscale(rope_mscale_all_dim) where both are set, else mscale(1), mscale(m) = 0.1 m ln(factor) + 1.
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    rope_attention_factor: float = 0.0
    rope_truncate: bool = True  # YaRN's blended dims rounded outward to whole dims (transformers' truncate)
    norm_eps: float = 1e-5
    # Model families as features of the one decoder (docs/models.md). qkv_bias: a bias on the q, k and v
    # projections (Qwen2 and Qwen2.5). qk_norm: RMSNorm over head_dim of each query and key head, before
    # RoPE, with its own scale per layer (Qwen3).
    qkv_bias: bool = False
    qk_norm: bool = False
    # Sliding-window attention (Mistral): a token attends to itself and the sliding_window - 1 tokens
    # before it (transformers' convention: query position - key position < sliding_window); 0: off.
    sliding_window: int = 0
    # Gemma 2 and 3 (docs/models.md). global_every > 0: with sliding_window, every global_every-th layer
    # (layer i where (i + 1) % global_every == 0) attends to the whole context and the others to the
    # window (Gemma 2: 2, Gemma 3: 6); 0: every layer has the window. rope_local_theta: the RoPE base of
    # the windowed layers (Gemma 3: 10000 where global layers use 1e6); 0: rope_theta.
    global_every: int = 0
    rope_local_theta: float = 0.0
    # Attention scores times query_scale ** -0.5 (Gemma's query_pre_attn_scalar); 0: head_dim ** -0.5.
    query_scale: float = 0.0
    # Soft-capping (Gemma 2): attention scores become cap * tanh(scores / cap) before the mask, and the
    # final logits likewise; 0: off.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # norm_plus_one: RMSNorm scales by (1 + w), its weights starting at 0 (Gemma). sandwich_norms: the
    # attention's and the MLP's outputs are normalised too before they join the residual (Gemma 2 and 3:
    # `post_attn_norm`, `post_mlp_norm`). embed_scale: the looked-up embeddings times sqrt(d_model).
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    mlp_activation: str = "silu"  # the gated MLP's gate: SwiGLU (silu) or GeGLU with tanh-approximate GELU
    # "auto": bfloat16 on accelerators and on CPUs that multiply bfloat16 in hardware (x86 AVX-512 BF16 or
    # AMX: shard.hardware.cpu_has_bf16_matmul), float32 on other CPUs. With remat "auto" (full on such a
    # CPU, none elsewhere) and its matmuls written as float32 (shard.models.matmuls), the CPU reference
    # config runs 1.4-1.5x float32 without remat's tokens/s in 30% less memory (benchmarks/side_by_side.py).
    # The tiny presets, the tests' models, pin float32 without remat: exact across layouts whatever the machine.
    compute_dtype: str = "auto"
    param_dtype: str = "float32"
    remat: str = "auto"
    # The loss's head in chunks of this many sequence positions, so only one chunk's logits exist at a
    # time (shard.models.xent); 0: the whole logits at once; -1 (auto): chunks of at most 8 MiB of
    # float32 logits per device, none where the whole logits are no bigger.
    loss_chunk: int = -1
    # "auto": cuDNN flash attention on NVIDIA GPUs where it applies, XLA's otherwise
    # (shard.sharding.decisions.attention_backend).
    attention: str = "auto"
    # XLA's attention (and the einsum one of soft-capped scores or windows that differ by layer) takes its
    # queries in chunks of at most this many, each chunk's exact softmax over all keys, recomputed in the
    # backward pass, so only one chunk's scores exist at a time (shard.models.attention.query_chunked);
    # 0: all queries at once; -1 (auto): chunks of at most 256 MiB of float32 scores per device, none
    # where the whole scores are no bigger. cuDNN's flash attention and ring attention need none.
    attention_chunk: int = -1
    # Mixture of experts (0 = dense): every layer's FFN becomes n_experts SwiGLU experts and a router.
    n_experts: int = 0
    experts_per_token: int = 2  # top-k routing
    capacity_factor: float = 1.25  # expert slots per group = ceil(k * tokens * factor / n_experts)
    aux_loss_weight: float = 0.01  # load-balancing loss (Switch Transformer) added to the objective
    # router z-loss (ST-MoE): the mean over tokens of logsumexp(router logits)^2, per layer, added with
    # this weight (1e-3 in ST-MoE); keeps the router's logits small. 0: off (still logged)
    router_z_loss_weight: float = 0.0
    # "dropless" (the default, as peers'): tokens sorted by expert through grouped matmuls (jax.lax.ragged_dot),
    # none dropped; "capacity": slots per expert and sequence, tokens beyond them dropped (GShard), kept to compare
    moe_routing: str = "dropless"
    router_scores: str = "softmax"  # over the experts, or "sigmoid": one score per expert (DeepSeek-V3)
    # the k chosen scores rescaled to sum to 1 (with softmax: Mixtral's softmax over the k chosen logits);
    # false: the gates are the scores themselves (Switch, Qwen2-MoE, DeepSeek-V2)
    router_normalize: bool = True
    routed_scale: float = 1.0  # the routed experts' gates times this (DeepSeek-V3: 2.5)
    n_shared_experts: int = 0  # SwiGLU experts of mlp_dim every token goes through beside its k routed ones
    # Auxiliary-loss-free balancing (DeepSeek-V3): the rate of a per-layer, per-expert bias added to the
    # scores to choose experts (not to gate them), moved by this much toward the mean load after each
    # step, outside the gradient; 0: off (no bias in the train state)
    router_bias_update: float = 0.0
    # Group-limited routing (DeepSeek-V3's n_group, topk_group): the experts in router_groups equal groups,
    # each group scored by the sum of its two best scores (+ bias); a token chooses its k experts among
    # the experts of its router_topk_groups best groups only. 1, 1: no limit.
    router_groups: int = 1
    router_topk_groups: int = 1
    # The first dense_layers layers have a dense gated MLP of dense_mlp_dim (0: mlp_dim) where the others
    # have experts (DeepSeek-V3's first_k_dense_replace: 3 layers of 18432); stored as a stack of their
    # own (`dense_layers/...`) run before the experts' (`dense_part`). 0: every layer has experts.
    dense_layers: int = 0
    dense_mlp_dim: int = 0
    # Multi-token prediction (DeepSeek-V3, shard.models.mtp): mtp_depth extra sequential modules, module k
    # predicting the token k + 1 further than the next one from the previous module's hidden state and the
    # embedding of the token k positions on, through one more layer of the main kind; they share the
    # embedding and the output head. Their mean losses, times mtp_loss_weight / mtp_depth, join the
    # objective (DeepSeek-V3: depth 1, weight 0.3 then 0.1) and are logged as `mtp_loss`. Training only:
    # generation ignores them. 0: off.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    # Multi-head latent attention (DeepSeek-V2/V3, shard.models.mla), on where kv_lora_rank > 0: keys and
    # values are up-projected from one compressed latent of kv_lora_rank per token (RMS-normalised), queries
    # from one of q_lora_rank (0: straight from the residual, no compression); each head's query and key
    # are qk_nope_head_dim without RoPE and qk_rope_head_dim with it, the RoPE key one per token shared by
    # every head; values are v_head_dim wide. head_dim must be qk_nope_head_dim + qk_rope_head_dim (the
    # scores' width) and n_kv_heads n_heads.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def validate(self) -> list[str]:
        """Problems with these hyperparameters, as one-line messages (empty when fine)."""
        problems = []
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim"):
            if not 0 < getattr(self, f) < 2**31:  # an array dimension: XLA indexes with int32
                problems.append(f"model.{f} must be positive and below 2**31, got {getattr(self, f)}")
        if self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads:
            problems.append(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads})"
            )
        if not 0 <= self.sliding_window < 2**31:
            problems.append(f"model.sliding_window must be 0 (off) or a number of tokens, got {self.sliding_window}")
        if not 0 <= self.global_every < 2**31:
            problems.append(f"model.global_every must be 0 (every layer windowed) or a number of layers, got "
                            f"{self.global_every}")
        elif self.global_every and not self.sliding_window:
            problems.append(f"model.global_every={self.global_every} needs a window (model.sliding_window > 0)")
        for f in ("rope_local_theta", "query_scale", "attn_softcap", "final_softcap"):
            if not 0 <= getattr(self, f) < math.inf:
                problems.append(f"model.{f} must be 0 (off) or a positive number, got {getattr(self, f)}")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            problems.append(f"model.mlp_activation must be one of {', '.join(MLP_ACTIVATIONS)}, got "
                            f"{self.mlp_activation!r}")
        elif self.mlp_activation != "silu" and self.n_experts:
            problems.append(f"model.mlp_activation={self.mlp_activation} can't apply to experts: they are SwiGLU")
        if not -1 <= self.loss_chunk < 2**31:
            problems.append(f"model.loss_chunk must be -1 (auto), 0 (off) or positions per chunk, got {self.loss_chunk}")
        if not -1 <= self.attention_chunk < 2**31:
            problems.append(f"model.attention_chunk must be -1 (auto), 0 (off) or queries per chunk, got "
                            f"{self.attention_chunk}")
        if self.head_dim % 2 and not self.mla:
            problems.append(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        problems += self._mla_problems() + self._group_problems() + self._dense_problems()
        problems += self._mtp_problems()
        for f, allowed in (("remat", REMAT_POLICIES), ("attention", ATTENTION_IMPLS),
                           ("compute_dtype", COMPUTE_DTYPES)):
            if getattr(self, f) not in allowed:
                problems.append(f"model.{f} must be one of {', '.join(allowed)}, got {getattr(self, f)!r}")
        if not 0 <= self.n_experts < 2**31:  # an array dimension too
            problems.append(f"model.n_experts must be 0 (dense) or more and below 2**31, got {self.n_experts}")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            problems.append(f"model.experts_per_token must be in 1..{self.n_experts}, got {self.experts_per_token}")
        if self.n_experts and not 0 < self.capacity_factor < math.inf:
            problems.append(f"model.capacity_factor must be a positive number, got {self.capacity_factor}")
        for f, allowed in (("moe_routing", MOE_ROUTINGS), ("router_scores", ROUTER_SCORES)):
            if getattr(self, f) not in allowed:
                problems.append(f"model.{f} must be one of {', '.join(allowed)}, got {getattr(self, f)!r}")
        if not 0 < self.routed_scale < math.inf:
            problems.append(f"model.routed_scale must be a positive number, got {self.routed_scale}")
        if not 0 <= self.n_shared_experts < 2**31:
            problems.append(f"model.n_shared_experts must be 0 or more and below 2**31, got {self.n_shared_experts}")
        elif self.n_shared_experts and not self.n_experts:
            problems.append(f"model.n_shared_experts={self.n_shared_experts} needs routed experts (model.n_experts > 0)")
        for f in ("rope_theta", "norm_eps"):
            if not 0 < getattr(self, f) < math.inf:
                problems.append(f"model.{f} must be a positive number, got {getattr(self, f)}")
        if not 0 <= self.rope_scaling < math.inf:
            problems.append(f"model.rope_scaling must be 0 (off) or a positive factor, got {self.rope_scaling}")
        if self.rope_scaling_type not in ROPE_SCALINGS:
            problems.append(f"model.rope_scaling_type must be one of {', '.join(ROPE_SCALINGS)}, got "
                            f"{self.rope_scaling_type!r}")
        elif self.rope_scaling and self.rope_scaling_type == "yarn":
            problems.extend(self._yarn_problems())
        elif self.rope_scaling and self.rope_scaling_type == "llama3" and not (
                0 < self.rope_low_freq_factor < self.rope_high_freq_factor < math.inf and self.rope_original_context > 0):
            problems.append("model.rope_scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor and a "
                            f"positive rope_original_context, got {self.rope_low_freq_factor}, "
                            f"{self.rope_high_freq_factor}, {self.rope_original_context}")
        if not 0 <= self.aux_loss_weight < math.inf:
            problems.append(f"model.aux_loss_weight must be >= 0, got {self.aux_loss_weight}")
        if not 0 <= self.router_z_loss_weight < math.inf:
            problems.append(f"model.router_z_loss_weight must be >= 0, got {self.router_z_loss_weight}")
        if not 0 <= self.router_bias_update < math.inf:
            problems.append(f"model.router_bias_update must be 0 (off) or a positive rate, got {self.router_bias_update}")
        elif self.router_bias_update and not self.n_experts:
            problems.append(f"model.router_bias_update={self.router_bias_update:g} needs routed experts (model.n_experts > 0)")
        if self.param_dtype not in ("float32", "bfloat16"):
            problems.append(f"model.param_dtype must be float32 or bfloat16, got {self.param_dtype!r}")
        return problems

    def _mla_problems(self) -> list[str]:
        """Problems with the multi-head latent attention fields."""
        fields = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        bad = [f for f in fields if not 0 <= getattr(self, f) < 2**31]
        if bad:
            return [f"model.{bad[0]} must be 0 or more and below 2**31, got {getattr(self, bad[0])}"]
        if not self.mla:
            if on := [f for f in fields if getattr(self, f)]:
                return [f"model.{on[0]}={getattr(self, on[0])} needs multi-head latent attention (model.kv_lora_rank > 0)"]
            return []
        if not self.qk_rope_head_dim or self.qk_rope_head_dim % 2:
            return [f"model.qk_rope_head_dim must be even and positive for RoPE, got {self.qk_rope_head_dim}"]
        if not self.v_head_dim:
            return ["model.v_head_dim must be positive with multi-head latent attention (model.kv_lora_rank > 0)"]
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            return [f"model.head_dim ({self.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
                    f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim}) with multi-head latent attention"]
        if self.n_kv_heads != self.n_heads:
            return [f"model.n_kv_heads ({self.n_kv_heads}) must be model.n_heads ({self.n_heads}) with multi-head "
                    "latent attention: every head has its own key and value"]
        if on := [f for f in ("qkv_bias", "qk_norm", "attn_softcap", "rope_local_theta") if getattr(self, f)]:
            return [f"model.{on[0]} can't be combined with multi-head latent attention (model.kv_lora_rank > 0)"]
        return []

    def _group_problems(self) -> list[str]:
        """Problems with group-limited routing."""
        G, top = self.router_groups, self.router_topk_groups
        if not 0 < G < 2**31 or not 0 < top < 2**31:
            return [f"model.router_groups and model.router_topk_groups must be positive, got {G} and {top}"]
        if top > G:
            return [f"model.router_topk_groups ({top}) must be at most model.router_groups ({G})"]
        if G == 1:
            return []
        if not self.n_experts or self.n_experts % G or self.n_experts // G < 2:
            return [f"model.router_groups={G} must divide model.n_experts ({self.n_experts}) into groups of at "
                    "least 2 experts (a group scores by its two best)"]
        if self.experts_per_token > top * (self.n_experts // G):
            return [f"model.experts_per_token ({self.experts_per_token}) must be at most the experts of "
                    f"router_topk_groups ({top}) groups of {self.n_experts // G}"]
        return []

    def _mtp_problems(self) -> list[str]:
        if not 0 <= self.mtp_depth < 2**31:
            return [f"model.mtp_depth must be 0 (off) or a number of modules, got {self.mtp_depth}"]
        if not 0 <= self.mtp_loss_weight < math.inf:
            return [f"model.mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}"]
        if self.mtp_depth and self.global_every:
            return ["model.mtp_depth can't be combined with model.global_every (local and global layers)"]
        return []

    def _dense_problems(self) -> list[str]:
        """Problems with dense first layers."""
        if not 0 <= self.dense_mlp_dim < 2**31:
            return [f"model.dense_mlp_dim must be 0 (mlp_dim) or a width below 2**31, got {self.dense_mlp_dim}"]
        if not self.dense_layers:
            return []
        if not 0 < self.dense_layers < self.n_layers or not self.n_experts:
            return [f"model.dense_layers={self.dense_layers} must be fewer than model.n_layers ({self.n_layers}) "
                    "in a mixture of experts (model.n_experts > 0): the first layers dense, the others with experts"]
        if self.global_every:
            return ["model.dense_layers can't be combined with model.global_every (local and global layers)"]
        return []

    @property
    def moe_layers(self) -> int:
        """The layers with experts (their router bias and expert load are per layer): n_layers less the
        dense first ones; 0 for a dense model."""
        return self.n_layers - self.dense_layers if self.n_experts else 0

    @property
    def router_bias_layers(self) -> int:
        """The rows of the router bias (auxiliary-loss-free balancing): the layers with experts, then the
        multi-token prediction modules' (their layers have experts too)."""
        return self.moe_layers + (self.mtp_depth if self.n_experts else 0)

    @property
    def dense_part(self) -> "ModelConfig":
        """The config of the dense first layers' stack (dense_layers): this model's, with that many layers,
        no experts and an MLP of dense_mlp_dim."""
        return dataclasses.replace(self, n_layers=self.dense_layers, n_experts=0, n_shared_experts=0,
                                   router_bias_update=0.0, router_groups=1, router_topk_groups=1, dense_layers=0,
                                   mlp_dim=self.dense_mlp_dim or self.mlp_dim, dense_mlp_dim=0)

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (shard.models.mla)."""
        return self.kv_lora_rank > 0

    @property
    def attention_scale(self) -> float:
        """The scores' factor before the softmax: query_scale ** -0.5 (0: head_dim ** -0.5); with multi-head
        latent attention and YaRN, times yarn_mscale(rope_scaling, rope_mscale_all_dim) squared, as
        DeepSeek-V3 scales every dim's scores, not only the rotated ones (transformers' yarn_apply_mscale)."""
        scale = (self.query_scale or self.head_dim) ** -0.5
        if self.mla and self.rope_scaling and self.rope_scaling_type == "yarn" and self.rope_mscale_all_dim:
            scale *= yarn_mscale(self.rope_scaling, self.rope_mscale_all_dim) ** 2
        return scale

    @property
    def rope_dim(self) -> int:
        """The dims RoPE rotates per head: head_dim, or with MLA the RoPE part qk_rope_head_dim."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        """Each head's value (and attention output) width: head_dim, or with MLA v_head_dim."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def padded_vocab(self) -> int:
        """The vocab dim of the stored tables and the logits: vocab_size rounded up to VOCAB_MULTIPLE
        (vocab_size itself when it is a multiple). The rows past vocab_size are never looked up, their
        logits are masked out (shard.models.llama.head_logits) and export-hf strips them."""
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    @property
    def router_bias(self) -> bool:
        """Whether the train state holds a router bias (auxiliary-loss-free balancing)."""
        return bool(self.n_experts and self.router_bias_update)

    def layer_windows(self) -> list[int]:
        """Each layer's attention window in tokens (0: the whole context)."""
        every = self.global_every
        return [0 if every and (i + 1) % every == 0 else self.sliding_window for i in range(self.n_layers)]

    @property
    def windows_vary(self) -> bool:
        """Whether layers differ in their window (local and global layers alternating)."""
        return len(set(self.layer_windows())) > 1

    def _yarn_problems(self) -> list[str]:
        problems = []
        if not 0 < self.rope_beta_slow < self.rope_beta_fast < math.inf:
            problems.append("model.rope_scaling_type=yarn needs 0 < rope_beta_slow < rope_beta_fast, got "
                            f"{self.rope_beta_slow}, {self.rope_beta_fast}")
        if self.rope_original_context <= 0:
            problems.append(f"model.rope_original_context must be positive, got {self.rope_original_context}")
        for f in ("rope_mscale", "rope_mscale_all_dim", "rope_attention_factor"):
            if not 0 <= getattr(self, f) < math.inf:
                problems.append(f"model.{f} must be 0 (unset) or a positive number, got {getattr(self, f)}")
        return problems

    def _rope_scaled(self, local: bool) -> bool:
        """Whether these layers' RoPE is scaled: the windowed layers with a base of their own are not."""
        return bool(self.rope_scaling) and not (local and self.rope_local_theta)

    def rope_attention_scale(self, local: bool = False) -> float:
        """The factor on RoPE's cos and sin (so on the scores, squared): YaRN's attention factor (the
        `attention_factor` transformers computes), 1 for every other kind."""
        if not self._rope_scaled(local) or self.rope_scaling_type != "yarn":
            return 1.0
        if self.rope_attention_factor:
            return self.rope_attention_factor
        if self.rope_mscale and self.rope_mscale_all_dim:
            return yarn_mscale(self.rope_scaling, self.rope_mscale) / yarn_mscale(self.rope_scaling,
                                                                                   self.rope_mscale_all_dim)
        return yarn_mscale(self.rope_scaling)

    def rope_frequencies(self, local: bool = False):
        """RoPE's inverse frequencies (numpy float32, rope_dim / 2 of them), scaled as rope_scaling and
        rope_scaling_type say; `local`: those of the windowed layers (rope_local_theta, unscaled, where set)."""
        import numpy as np

        theta = self.rope_local_theta if local and self.rope_local_theta else self.rope_theta
        # in float64, rounded to float32 once at the end
        inv = 1.0 / theta ** (np.arange(0, self.rope_dim, 2, dtype=np.float64) / self.rope_dim)
        if not self._rope_scaled(local):
            return inv.astype(np.float32)
        if self.rope_scaling_type == "linear":
            return (inv / self.rope_scaling).astype(np.float32)
        if self.rope_scaling_type == "yarn":
            return self._yarn_frequencies(inv, theta).astype(np.float32)
        factor, low, high, context = (self.rope_scaling, self.rope_low_freq_factor, self.rope_high_freq_factor,
                                      self.rope_original_context)
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > context / low, inv / factor, inv)
        smooth = (context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        between = (wavelen >= context / high) & (wavelen <= context / low)
        return np.where(between, blended, scaled).astype(np.float32)

    def _yarn_frequencies(self, inv, theta: float):
        """YaRN's blend (transformers' _compute_yarn_parameters): the dims that turn fewer than beta_slow
        times over rope_original_context divided by the factor (interpolated), those turning more than
        beta_fast times kept (extrapolated), a linear ramp between."""
        import numpy as np

        dim, context = self.rope_dim, self.rope_original_context

        def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over the context
            return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(self.rope_beta_fast), dim_of(self.rope_beta_slow)
        if self.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        # transformers ramps in float32
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        keep = 1 - ramp.astype(np.float64)
        return inv / self.rope_scaling * (1 - keep) + inv * keep

    def compute_dtype_on(self, platform: str) -> str:
        """The compute dtype's name on `platform` ("cpu", "gpu", "cuda", ...): "auto" resolves to bfloat16,
        except on a CPU without bfloat16 matmul instructions (float32)."""
        if self.compute_dtype != "auto":
            return self.compute_dtype
        return "bfloat16" if platform != "cpu" or _cpu_bf16() else "float32"

    def for_inference(self, platform: str) -> "ModelConfig":
        """This config as generation and evaluation run it: "auto" computes in float32 on a CPU. bfloat16
        pays on a CPU in training, where full remat keeps its activations small; scoring or sampling
        would hold bfloat16 copies of the weights beside them. (This was weighed when XLA:CPU ran
        bfloat16 matmuls as float32 ones; written as float32 they run about twice float32's rate now,
        shard.models.matmuls, and inference in bfloat16 on a CPU is not measured again.)"""
        if self.compute_dtype == "auto" and platform == "cpu":
            return dataclasses.replace(self, compute_dtype="float32")
        return self

    def remat_on(self, platform: str) -> str:
        """The remat policy on `platform`: "auto" is full on a CPU with bfloat16 matmul instructions (where
        recomputing costs no speed and saves memory), none elsewhere."""
        if self.remat != "auto":
            return self.remat
        return "full" if platform == "cpu" and _cpu_bf16() else "none"

    def expert_capacity(self, tokens_per_group: int) -> int:
        """Slots each expert has per routing group (a sequence); tokens routed beyond it are dropped."""
        return max(1, math.ceil(self.experts_per_token * tokens_per_group * self.capacity_factor / self.n_experts))

    def param_shapes(self) -> list[tuple[str, tuple[int, ...], tuple[str | None, ...]]]:
        """(path, shape, logical axes) of every parameter of shard/models/llama.py, from the parameter
        tables (shard.config.params.model_params, in its order)."""
        return list(_param_shapes(self))

    def num_params(self) -> int:
        """The model's own parameter count, from the hyperparameters alone (what transformers counts):
        the stored tables' padded vocab rows are not in it (vocab_padding_params)."""
        return sum(math.prod(shape) for _, shape, _ in self.param_shapes()) - self.vocab_padding_params()

    def vocab_padding_params(self) -> int:
        """Parameters in the stored tables' rows past vocab_size (padded_vocab): stored, never used."""
        return sum(math.prod(shape) // self.padded_vocab * (self.padded_vocab - self.vocab_size)
                   for _, shape, axes in self.param_shapes() if "vocab" in axes)


def cache_bytes_per_token(cfg: ModelConfig, platform: str) -> tuple[int, int]:
    """(bytes generation's cache holds per token over all layers, in the compute dtype on `platform`;
    those keys and values of every head would take): with multi-head latent attention the latent and
    the shared RoPE key (kv_lora_rank + qk_rope_head_dim per layer) against N (head_dim + v_head_dim);
    with grouped-query attention 2 K head_dim against 2 N head_dim."""
    size = 2 if cfg.compute_dtype_on(platform) == "bfloat16" else 4
    if cfg.mla:
        held, full = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.n_heads * (cfg.head_dim + cfg.v_head_dim)
    else:
        held, full = 2 * cfg.n_kv_heads * cfg.head_dim, 2 * cfg.n_heads * cfg.head_dim
    return cfg.n_layers * held * size, cfg.n_layers * full * size


def cache_line(cfg: ModelConfig, platform: str) -> str:
    """What `shard generate` says of its cache: bytes per token, and beside them the full heads'."""
    held, full = cache_bytes_per_token(cfg, platform)
    kind = "latent (MLA)" if cfg.mla else f"{cfg.n_kv_heads} kv heads"
    return f"KV cache: {held:,} bytes per token, {kind}; keys and values of all {cfg.n_heads} heads: {full:,}"


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(ModelConfig))


@functools.lru_cache(maxsize=64)
def _param_shapes(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...], tuple[str | None, ...]], ...]:
    """ModelConfig.param_shapes, once per config: the planner asks for it thousands of times a plan."""
    return tuple((path, p.shape, p.axes) for path, p in model_params(cfg).items())
