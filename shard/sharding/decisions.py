"""Decisions the model and the planner share, made here once so that `shard plan` predicts what the
compiled step does: which lookup reads the stored table, whether the ring is balanced, which attention
implementation runs, and in how many chunks the loss and the attention take their positions and
queries. Pure functions of sizes, mesh axis sizes and rule tables (the planner asks them of layouts it
never builds), without JAX; the model asks them of its active layout through shard.sharding.queries,
and of its trace in shard.models.attention and shard.models.xent.
"""

import math

from shard.axes import BATCH, EMBED, STAGE, VOCAB
from shard.config.model import ModelConfig


def axes_table(sizes: dict[str, int], rules, param_rules=None) -> dict[str, tuple[str, ...]]:
    """Logical axis -> the mesh axes of size > 1 it is split over (parameters: `param_rules` on top)."""
    merged = dict(rules) | dict(param_rules or {})
    return {k: tuple(a for a in v if sizes.get(a, 1) > 1) for k, v in merged.items()}


def stored_lookup_axes(vocab_size: int, tokens: float, sizes: dict[str, int], rules,
                       param_rules) -> dict[str, int]:
    """Mesh axes (with sizes) over which the token lookup reads the embedding table as stored
    (shard.models.llama): those that split the stored table's embed dim but not the activations' (FSDP),
    when the ids the devices of that split look up together, `tokens` over the batch ways that remain,
    are fewer than each device's rows of the table, and when those of the split that split the batch
    are its innermost axes. {} when the lookup reads a gathered table.

    The looked-up rows go from the split to the batch layout by an all-to-all within each group of the
    split only if each group's rows are its own block of the batch; with the split outside another batch
    axis (fsdp=2,expert=4: batch over fsdp then expert) they are not, and XLA replicated the rows and
    their gradient ("involuntary full rematerialization", twice a step).
    Takes the mesh and rules apart (not a LayoutShape), as the model asks on any mesh."""
    acts, params = axes_table(sizes, rules), axes_table(sizes, rules, param_rules)
    split = {a: sizes[a] for a in params.get(EMBED, ()) if a not in acts.get(EMBED, ())}
    batch = acts.get(BATCH, ())
    in_batch = tuple(a for a in batch if a in split)
    if not split or batch[len(batch) - len(in_batch):] != in_batch:
        return {}
    kept = math.prod(sizes[a] for a in batch if a not in split)
    rows = vocab_size / math.prod(sizes[a] for a in params.get(VOCAB, ()))
    return split if tokens / kept < rows else {}


def head_vocab_split_axes(cfg: ModelConfig, tokens: float, sizes: dict[str, int], rules, param_rules,
                          chunks: int = 1) -> dict[str, int]:
    """Mesh axes (with sizes) over which the untied head's loss splits the vocabulary instead of the
    batch: the stored lookup's (`stored_lookup_axes`: FSDP axes that split the batch, where the tokens
    are fewer than each device's rows of the table), where the loss is not chunked (`chunks`, as
    `loss_chunks` decides) and there are no pipeline stages. Each device then multiplies the tokens of
    the devices it shares the split with by its slice of the vocab: the tokens are gathered, their
    gradient reduce-scattered, the weight passed between its stored and its vocab-split layout by
    all-to-all; gathered instead, the whole (D, V) weight went to each device and its whole gradient back
    (2 x 33 MB per device on the CPU reference config, fsdp=8). Not where tensor parallel already splits
    the vocab (the head gathers a model-th of the weight there, and the loss is chunked by default).
    {} where the head reads a gathered weight."""
    if cfg.tie_embeddings or chunks > 1 or sizes.get(STAGE, 1) > 1 or axes_table(sizes, rules).get(VOCAB):
        return {}
    return stored_lookup_axes(cfg.padded_vocab, tokens, sizes, rules, param_rules)


def balanced_ring(cfg: ModelConfig, seq_len: int, context: int) -> bool:
    """Does ring attention run load-balanced (the zig-zag order, shard.parallel.ring_attention)? Where
    the sequence is split (`context` > 1) into 2 x context chunks, for a dense model (a mixture of
    experts keeps the tokens' order: which overflow an expert depends on it)."""
    return context > 1 and seq_len % (2 * context) == 0 and not cfg.n_experts


# --- the attention's implementation -------------------------------------------------------------------------


def cudnn_attention_problem(*, platform: str, dtype: str, head_dim: int, same_split: bool = True,
                            manual: bool = False, segments: bool = False) -> str:
    """Why cuDNN's flash attention (jax.nn.dot_product_attention(implementation="cudnn")) can't run
    attention with these inputs, in a few words; "" when it can.

    `platform` is "cuda" for NVIDIA GPUs. cuDNN takes 16-bit inputs and head dims that are multiples of 8
    up to 128 (256 on Hopper; the lower bound keeps the answer independent of the GPU), and its sharding
    rule needs queries and keys split alike (heads and kv_heads on the same mesh axes). Inside a
    partly manual shard_map (pipeline stages) its custom partitioning is not used. Packed rows
    (`segments`, data.packing=packed) reach it only as a dense (B, 1, T, T) bias through the public API
    (shard.models.attention.causal_attention says why that is not taken).
    """
    if platform != "cuda":
        return f"it needs an NVIDIA GPU (this run is on {platform})"
    if dtype not in ("bfloat16", "float16"):
        return f"it needs bfloat16 or float16 compute (this run computes in {dtype})"
    if head_dim % 8 or head_dim > 128:
        return f"it needs a head dim that is a multiple of 8 up to 128 (got {head_dim})"
    if not same_split:
        return "it needs heads and kv_heads split over the same mesh axes"
    if manual:
        return "it does not run inside pipeline stages"
    if segments:
        return "packed rows (data.packing=packed) need a per-document mask, which it takes only as a dense bias"
    return ""


def attention_backend(setting: str, problem: str) -> str:
    """The attention implementation a `model.attention` setting runs as, given cuDNN's `problem` with the
    inputs (cudnn_attention_problem): "auto" is "cudnn" when there is none, "xla" otherwise."""
    if setting == "auto":
        return "xla" if problem else "cudnn"
    return setting


# --- chunks of the loss and of the attention ----------------------------------------------------------------


# Auto chunking of the loss (model.loss_chunk = -1) keeps one chunk's float32 logits per device at most
# this big, where the chunks' least size (below) allows; logits that fit are not chunked (shard.models.xent).
CHUNK_LOGITS_BYTES = 8 * 2**20
# Per device, a chunk holds no fewer than CHUNK_MIN_TOKENS tokens (smaller chunks' matmuls waste the
# machine more than they save), nor fewer than the embedding dim D while its float32 logits stay within
# CHUNK_LOGITS_MAX_BYTES: every chunk reads and writes the float32 D x V sum of the head weight's gradient
# (8 D V bytes), as many as its own float32 logits and their gradient (8 t V) at t = D tokens. The
# reference config on one CPU device (D 256, 2,048 tokens): 32 chunks of 64 tokens run 2,261-2,391
# tokens/s, 8 of 256 run 2,628-2,837, at the same peak RSS.
CHUNK_MIN_TOKENS = 64
CHUNK_LOGITS_MAX_BYTES = 256 * 2**20  # the D-token chunks' cap (llama-1b: 8 chunks of 1,024 tokens, not 4)
# Auto chunks only where a device holds this many tokens per embedding dim at least: the chunks keep a
# float32 D x V weight-gradient sum, which costs what they save at about one token per dim (compiled, the
# CPU reference config at fsdp=8 in bf16 with full remat, 256 tokens of D 256: 117 -> 129 MiB chunked;
# at fsdp=2,model=4, 1024 tokens: 100 -> 53 MiB).
CHUNK_MIN_TOKENS_PER_D = 2


def loss_chunks(cfg: ModelConfig, batch: int, seq_len: int, batch_ways: int = 1, length_ways: int = 1,
                vocab_ways: int = 1) -> int:
    """How many chunks the loss takes the sequence's positions in (1: the whole logits at once), for
    `batch` rows of `seq_len` split over these ways. model.loss_chunk > 0 is the positions per chunk; 0 is
    off; -1 (auto) the fewest chunks whose float32 logits stay within CHUNK_LOGITS_BYTES per device, but
    none under CHUNK_MIN_TOKENS tokens per device, nor under the embedding dim's where that many tokens'
    logits fit in CHUNK_LOGITS_MAX_BYTES (else under what fits), each chunk a whole number of positions
    per device, and none where a device holds fewer than CHUNK_MIN_TOKENS_PER_D tokens per embedding dim."""
    if cfg.loss_chunk == 0 or seq_len <= 1:
        return 1
    if cfg.loss_chunk > 0:
        return max(1, seq_len // cfg.loss_chunk)
    local_t = seq_len // max(length_ways, 1)
    rows = max(batch // max(batch_ways, 1), 1)
    if local_t * rows < CHUNK_MIN_TOKENS_PER_D * cfg.d_model:
        return 1  # the chunks' float32 sum of the head weight's gradient (D x V) would cost what they save
    per_position = rows * cfg.padded_vocab / max(vocab_ways, 1) * 4
    fewest_tokens = max(CHUNK_MIN_TOKENS, min(cfg.d_model, int(CHUNK_LOGITS_MAX_BYTES * rows // per_position)))
    n = 1
    for k in range(1, local_t + 1):
        if local_t % k == 0 and (local_t // k) * rows >= fewest_tokens:
            n = k
            if local_t // k * per_position <= CHUNK_LOGITS_BYTES:
                break
    return n


# Auto chunking of XLA's attention (model.attention_chunk = -1) keeps one chunk's float32 scores per device
# at most this big; scores that fit are not chunked. llama-1b at batch 4 x 2048 on one device has 2 GiB of
# scores per layer: 8 chunks of 256 queries.
ATTENTION_CHUNK_SCORES_BYTES = 256 * 2**20
ATTENTION_CHUNK_MIN_QUERIES = 128  # smaller chunks' matmuls waste the machine more than they save


def attention_chunks(setting: int, seq_len: int, rows: int, heads: int, keys: int | None = None) -> int:
    """How many chunks of contiguous queries XLA's attention takes a sequence's `seq_len` in (1: all at
    once), for `rows` sequences and `heads` query heads per device attending to `keys` keys (seq_len by
    default). `setting` is model.attention_chunk: > 0 the most queries per chunk, 0 off, -1 (auto) the
    fewest chunks whose float32 scores stay within ATTENTION_CHUNK_SCORES_BYTES per device, none under
    ATTENTION_CHUNK_MIN_QUERIES queries. Chunks are equal: their number divides seq_len, each chunk as
    long as that allows up to the most."""
    if setting == 0 or seq_len <= 1:
        return 1
    queries = setting
    if setting < 0:
        per_query = rows * heads * (keys or seq_len) * 4
        if seq_len * per_query <= ATTENTION_CHUNK_SCORES_BYTES:
            return 1
        queries = max(ATTENTION_CHUNK_SCORES_BYTES // per_query, ATTENTION_CHUNK_MIN_QUERIES)
    return next(n for n in range(1, seq_len + 1) if seq_len % n == 0 and seq_len // n <= queries)
