"""Every logical axis name, defined once. Models name these; mesh presets map them to mesh axes.

Letters follow the scaling-book convention and appear in einsum strings and variable suffixes.
"""

__all__ = ["BATCH", "LENGTH", "EMBED", "HEADS", "KV_HEADS", "HEAD_DIM", "MLP", "VOCAB", "LAYERS",
           "RES_LENGTH", "EXPERT", "EXPERT_BATCH", "LORA_RANK", "LATENT", "LOGICAL_AXES", "ACTIVATION_LAYOUTS",
           "MOE_ACTIVATION_LAYOUTS", "DATA", "FSDP", "STAGE", "EXPERT_AXIS", "CONTEXT", "MODEL", "MESH_AXES"]

BATCH = "batch"  # B: sequences in a (micro)batch
LENGTH = "length"  # T: positions in a sequence
EMBED = "embed"  # D: model width, the residual stream
HEADS = "heads"  # N: query heads
KV_HEADS = "kv_heads"  # K: key/value heads (grouped-query attention: N is a multiple of K)
HEAD_DIM = "head_dim"  # H: width of one head
MLP = "mlp"  # F: hidden width of the feed-forward block
VOCAB = "vocab"  # V: token vocabulary
LAYERS = "layers"  # L: stacked, scanned layers (split into pipeline stages when `layers` maps to stage)
RES_LENGTH = "res_length"  # T in the residual stream (norms, residual adds): Megatron-SP shards it
EXPERT = "expert"  # E: experts of a mixture-of-experts layer
EXPERT_BATCH = "expert_batch"  # B once tokens are dispatched to experts: the batch axes less the expert axis
LORA_RANK = "lora_rank"  # R: the rank of a LoRA adapter (A: in -> R, B: R -> out); replicated by default
LATENT = "latent"  # C: multi-head latent attention's compressed query or key-value width (q/kv_lora_rank)

LOGICAL_AXES = (BATCH, LENGTH, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, LAYERS, RES_LENGTH, EXPERT,
                EXPERT_BATCH, LORA_RANK, LATENT)

# The layouts the models constrain with the activation rules (shard/models/llama.py, the cast embedding tables
# included; shard/models/moe.py): a rule table must give each a valid PartitionSpec (no mesh axis twice),
# which is checked before anything is traced.
ACTIVATION_LAYOUTS = (
    (BATCH, LENGTH), (BATCH, LENGTH, EMBED), (BATCH, RES_LENGTH, EMBED), (BATCH, LENGTH, HEADS, HEAD_DIM),
    (BATCH, LENGTH, KV_HEADS, HEAD_DIM), (BATCH, LENGTH, MLP), (BATCH, LENGTH, VOCAB), (VOCAB, EMBED),
    (EMBED, VOCAB), (BATCH, LENGTH, LATENT),
)
MOE_ACTIVATION_LAYOUTS = ((EXPERT, EXPERT_BATCH, None, EMBED), (EXPERT, EXPERT_BATCH, None, MLP))

# Mesh axes shard knows how to use. Order is the outer-to-inner order of a mesh built from them:
# pipeline stages outermost (point-to-point traffic, once per microbatch), then the data-parallel
# axes (they may cross hosts), tensor parallel innermost (the heaviest traffic).
DATA = "data"  # pure data parallel: parameters replicated, gradients all-reduced
FSDP = "fsdp"  # data parallel with parameters, gradients and optimizer state sharded (ZeRO-3)
STAGE = "stage"  # pipeline parallel: the layer stack split into stages, microbatches passed along
EXPERT_AXIS = "expert"  # expert parallel: MoE experts split, tokens dispatched by all-to-all
CONTEXT = "context"  # context parallel: sequence split, attention by a ring of key/value blocks
MODEL = "model"  # Megatron tensor parallel: heads and FFN hidden dim split

MESH_AXES = (STAGE, DATA, FSDP, EXPERT_AXIS, CONTEXT, MODEL)
