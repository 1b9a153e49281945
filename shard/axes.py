"""Every logical axis name, defined once. Models name these; mesh presets map them to mesh axes.

Letters follow the scaling-book convention and appear in einsum strings and variable suffixes.
"""

BATCH = "batch"  # B: sequences in a (micro)batch
LENGTH = "length"  # T: positions in a sequence
EMBED = "embed"  # D: model width, the residual stream
HEADS = "heads"  # N: query heads
KV_HEADS = "kv_heads"  # K: key/value heads (grouped-query attention: N is a multiple of K)
HEAD_DIM = "head_dim"  # H: width of one head
MLP = "mlp"  # F: hidden width of the feed-forward block
VOCAB = "vocab"  # V: token vocabulary
LAYERS = "layers"  # L: stacked, scanned layers

LOGICAL_AXES = (BATCH, LENGTH, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, LAYERS)

# Mesh axes shard knows how to use. Order is the outer-to-inner order of a mesh built from them:
# data-parallel axes outermost (cheapest traffic, so they may cross hosts), tensor parallel innermost.
DATA = "data"  # pure data parallel: parameters replicated, gradients all-reduced
FSDP = "fsdp"  # data parallel with parameters, gradients and optimizer state sharded (ZeRO-3)
MODEL = "model"  # Megatron tensor parallel: heads and FFN hidden dim split

MESH_AXES = (DATA, FSDP, MODEL)
