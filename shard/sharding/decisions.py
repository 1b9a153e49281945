"""Layout decisions the model and the planner share, made here once so that `shard plan` predicts what
the compiled step does. Pure functions of mesh axis sizes and rule tables (the planner asks them of
layouts it never builds), without JAX; the model asks them of its active layout through
shard.sharding.queries.
"""

import math

from shard.axes import BATCH, EMBED, VOCAB
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


def balanced_ring(cfg: ModelConfig, seq_len: int, context: int) -> bool:
    """Does ring attention run load-balanced (the zig-zag order, shard.parallel.ring_attention)? Where
    the sequence is split (`context` > 1) into 2 x context chunks, for a dense model (a mixture of
    experts keeps the tokens' order: which overflow an expert depends on it)."""
    return context > 1 and seq_len % (2 * context) == 0 and not cfg.n_experts
