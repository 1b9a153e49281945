"""The named model presets (`--model NAME`, model.name): real models' shapes, family by family, and the
tiny twins the tests run. Pure data: importing this never imports JAX."""

import dataclasses

from shard.config.model import ModelConfig

# Gemma's features beyond Llama's that both Gemma 2 and Gemma 3 have
_GEMMA = dict(norm_plus_one=True, sandwich_norms=True, embed_scale=True, mlp_activation="gelu_tanh", tie_embeddings=True)

PRESETS: dict[str, ModelConfig] = {
    # Tests: every dimension divides 8, so any 8-device layout applies.
    "tiny": ModelConfig(name="tiny", d_model=64, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=8, mlp_dim=128),
    # The default run: a byte-level model that learns visibly in a few minutes on a laptop CPU.
    "small": ModelConfig(name="small"),
    # Mixture of experts for tests and benchmarks: tiny with 8 top-2 experts in every layer.
    "moe-tiny": ModelConfig(name="moe-tiny", d_model=64, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=8,
                            mlp_dim=64, n_experts=8, experts_per_token=2),
    # DeepSeek-style fine-grained experts, tiny: 16 small routed experts, top-4 by sigmoid scores, one
    # shared expert, dropless.
    "moe-fine-tiny": ModelConfig(name="moe-fine-tiny", d_model=64, n_layers=2, n_heads=8, n_kv_heads=8,
                                 head_dim=8, mlp_dim=32, n_experts=16, experts_per_token=4,
                                 n_shared_experts=1, moe_routing="dropless", router_scores="sigmoid"),
    # DeepSeekMoE 16B's shape (fine-grained experts): 64 routed experts of width 1408, top-6 by a softmax
    # kept as is (no renormalisation), 2 shared experts, dropless; every layer is a MoE layer (DeepSeekMoE's
    # first is dense). Its tiny twin keeps the experts and the router, with tiny's attention and width.
    "deepseek-moe-16b": ModelConfig(name="deepseek-moe-16b", vocab_size=102400, d_model=2048, n_layers=28,
                                    n_heads=16, n_kv_heads=16, head_dim=128, mlp_dim=1408, tie_embeddings=False,
                                    n_experts=64, experts_per_token=6, n_shared_experts=2, moe_routing="dropless",
                                    router_normalize=False, aux_loss_weight=0.001),
    "deepseek-moe-tiny": ModelConfig(name="deepseek-moe-tiny", d_model=64, n_layers=2, n_heads=8, n_kv_heads=8,
                                     head_dim=8, mlp_dim=16, tie_embeddings=False, n_experts=64,
                                     experts_per_token=6, n_shared_experts=2, moe_routing="dropless",
                                     router_normalize=False, aux_loss_weight=0.001),
    # DeepSeek-V3 (671B, 37B active) and Kimi K2 (1T, 32B active): multi-head latent attention (a 512-wide
    # key-value latent and 64 RoPE dims per head shared across its 128 or 64 heads, queries through a
    # 1536-wide latent), 256 or 384 routed experts of width 2048, top 8 by sigmoid scores renormalised and
    # scaled, one shared expert, auxiliary-loss-free balancing; DeepSeek-V3 limits each token to 4 of 8
    # expert groups; their first 3 (1) layers are dense, of width 18432. The presets are the 4K-context
    # models without DeepSeek-V3's multi-token prediction module: their checkpoints' YaRN (factor 40 / 32)
    # and MTP layer come with import-hf, or by model.rope_* and model.mtp_depth = 1. The tiny twin keeps
    # every feature with tiny's width (every dim divides 8): one dense layer, then two with experts.
    "deepseek-v3": ModelConfig(name="deepseek-v3", vocab_size=129280, d_model=7168, n_layers=61, n_heads=128,
                               n_kv_heads=128, head_dim=192, mlp_dim=2048, tie_embeddings=False, norm_eps=1e-6,
                               n_experts=256, experts_per_token=8, n_shared_experts=1, moe_routing="dropless",
                               router_scores="sigmoid", routed_scale=2.5, router_groups=8, router_topk_groups=4,
                               router_bias_update=0.001, aux_loss_weight=0.0001, q_lora_rank=1536,
                               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                               dense_layers=3, dense_mlp_dim=18432),
    "kimi-k2": ModelConfig(name="kimi-k2", vocab_size=163840, d_model=7168, n_layers=61, n_heads=64, n_kv_heads=64,
                           head_dim=192, mlp_dim=2048, tie_embeddings=False, norm_eps=1e-6, rope_theta=50000.0,
                           n_experts=384, experts_per_token=8, n_shared_experts=1, moe_routing="dropless",
                           router_scores="sigmoid", routed_scale=2.827, router_bias_update=0.001,
                           aux_loss_weight=0.0001, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                           qk_rope_head_dim=64, v_head_dim=128, dense_layers=1, dense_mlp_dim=18432),
    "deepseek-v3-tiny": ModelConfig(name="deepseek-v3-tiny", d_model=64, n_layers=3, n_heads=8, n_kv_heads=8,
                                    head_dim=16, mlp_dim=32, tie_embeddings=False, norm_eps=1e-6, n_experts=16,
                                    experts_per_token=4, n_shared_experts=1, moe_routing="dropless",
                                    router_scores="sigmoid", routed_scale=2.5, router_groups=4,
                                    router_topk_groups=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                                    qk_rope_head_dim=8, v_head_dim=8, dense_layers=1, dense_mlp_dim=64),
    # Llama 3.2 1B shape.
    "llama-1b": ModelConfig(name="llama-1b", vocab_size=128256, d_model=2048, n_layers=16, n_heads=32,
                            n_kv_heads=8, head_dim=64, mlp_dim=8192, rope_theta=500000.0),
    # Llama 2 7B and 13B shapes.
    "llama-7b": ModelConfig(name="llama-7b", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                            n_kv_heads=32, head_dim=128, mlp_dim=11008, tie_embeddings=False),
    "llama-13b": ModelConfig(name="llama-13b", vocab_size=32000, d_model=5120, n_layers=40, n_heads=40,
                             n_kv_heads=40, head_dim=128, mlp_dim=13824, tie_embeddings=False),
    # The reference workload of ARCHITECTURE.md: 24 layers, ~13.1B parameters (8 nodes x 4 A100).
    "llama-13b-24l": ModelConfig(name="llama-13b-24l", vocab_size=32000, d_model=6144, n_layers=24,
                                 n_heads=48, n_kv_heads=48, head_dim=128, mlp_dim=20480,
                                 tie_embeddings=False),
    # Model families (docs/models.md): one real size each, and a tiny twin for tests whose dimensions
    # divide 8 (heads 16 x head_dim 8 != d_model: head_dim is its own).
    "qwen2.5-0.5b": ModelConfig(name="qwen2.5-0.5b", vocab_size=151936, d_model=896, n_layers=24, n_heads=14,
                                n_kv_heads=2, head_dim=64, mlp_dim=4864, rope_theta=1e6, norm_eps=1e-6,
                                qkv_bias=True),
    "qwen3-0.6b": ModelConfig(name="qwen3-0.6b", vocab_size=151936, d_model=1024, n_layers=28, n_heads=16,
                              n_kv_heads=8, head_dim=128, mlp_dim=3072, rope_theta=1e6, norm_eps=1e-6, qk_norm=True),
    "qwen2-tiny": ModelConfig(name="qwen2-tiny", d_model=64, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=8,
                              mlp_dim=128, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
    "qwen3-tiny": ModelConfig(name="qwen3-tiny", d_model=64, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=8,
                              mlp_dim=128, rope_theta=1e6, norm_eps=1e-6, qk_norm=True),
    # Qwen3-30B-A3B: Qwen3 with 128 experts of width 768 in every layer, top 8, renormalised, dropless as
    # transformers runs it; the tiny twin has 8 experts, top 2.
    "qwen3-30b-a3b": ModelConfig(name="qwen3-30b-a3b", vocab_size=151936, d_model=2048, n_layers=48, n_heads=32,
                                 n_kv_heads=4, head_dim=128, mlp_dim=768, tie_embeddings=False, rope_theta=1e6,
                                 norm_eps=1e-6, qk_norm=True, n_experts=128, experts_per_token=8,
                                 aux_loss_weight=0.001, moe_routing="dropless"),
    "qwen3-moe-tiny": ModelConfig(name="qwen3-moe-tiny", d_model=64, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=8,
                                  mlp_dim=32, tie_embeddings=False, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
                                  n_experts=8, experts_per_token=2, aux_loss_weight=0.001, moe_routing="dropless"),
    # Mistral 7B v0.1 (a 4096-token window) and Mixtral 8x7B v0.1 (its experts routed dropless, as
    # transformers runs them); the tiny twins' window (8) is shorter than the tests' sequences.
    "mistral-7b": ModelConfig(name="mistral-7b", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                              n_kv_heads=8, head_dim=128, mlp_dim=14336, tie_embeddings=False, sliding_window=4096),
    "mixtral-8x7b": ModelConfig(name="mixtral-8x7b", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                                n_kv_heads=8, head_dim=128, mlp_dim=14336, tie_embeddings=False, rope_theta=1e6,
                                n_experts=8, experts_per_token=2, aux_loss_weight=0.02, moe_routing="dropless"),
    "mistral-tiny": ModelConfig(name="mistral-tiny", d_model=64, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=8,
                                mlp_dim=128, tie_embeddings=False, sliding_window=8),
    # Gemma 2 2B and the text model of Gemma 3 1B: GeGLU, (1 + w) norms around each sublayer, scaled and
    # tied embeddings, local layers with a window and global ones every 2nd (Gemma 2, soft-capped) or
    # 6th layer (Gemma 3, with q/k norms and a RoPE base per layer type). The tiny twins alternate local
    # and global layers (every 2nd) over 4 layers, with a window (8) shorter than the tests' sequences.
    "gemma2-2b": ModelConfig(name="gemma2-2b", vocab_size=256000, d_model=2304, n_layers=26, n_heads=8, n_kv_heads=4,
                             head_dim=256, mlp_dim=9216, norm_eps=1e-6, sliding_window=4096, global_every=2,
                             query_scale=256.0, attn_softcap=50.0, final_softcap=30.0, **_GEMMA),
    "gemma3-1b": ModelConfig(name="gemma3-1b", vocab_size=262144, d_model=1152, n_layers=26, n_heads=4, n_kv_heads=1,
                             head_dim=256, mlp_dim=6912, norm_eps=1e-6, rope_theta=1e6, rope_local_theta=10000.0,
                             sliding_window=512, global_every=6, query_scale=256.0, qk_norm=True, **_GEMMA),
    "gemma2-tiny": ModelConfig(name="gemma2-tiny", d_model=64, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=8,
                               mlp_dim=128, norm_eps=1e-6, sliding_window=8, global_every=2, query_scale=16.0,
                               attn_softcap=50.0, final_softcap=30.0, **_GEMMA),
    "gemma3-tiny": ModelConfig(name="gemma3-tiny", d_model=64, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=8,
                               mlp_dim=128, norm_eps=1e-6, rope_theta=1e6, rope_local_theta=10000.0, sliding_window=8,
                               global_every=2, query_scale=16.0, qk_norm=True, **_GEMMA),
    "mixtral-tiny": ModelConfig(name="mixtral-tiny", d_model=64, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=8,
                                mlp_dim=64, tie_embeddings=False, rope_theta=1e6, n_experts=8, experts_per_token=2,
                                aux_loss_weight=0.02, moe_routing="dropless", sliding_window=8),
}
# The tiny presets are the tests' models: float32 without remat, so their runs compare across layouts at
# rtol 1e-5 on any machine ("auto" is bfloat16 with full remat on a CPU with bfloat16 matmuls).
PRESETS |= {name: dataclasses.replace(cfg, compute_dtype="float32", remat="none")
            for name, cfg in PRESETS.items() if name == "tiny" or name.endswith("-tiny")}
