"""Layout decisions the model and the planner share, and the questions the model asks of the active
layout. Each decision is made here once, so `shard plan` predicts what the compiled step does.

The pure decisions take mesh axis sizes and rule tables (the planner asks them of layouts it never
builds); the questions read the layout the step is traced under (`activation_layout`).
"""

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shard.axes import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, LENGTH, VOCAB
from shard.config.model import ModelConfig
from shard.sharding.rules import active_layout, mesh_axes_of


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


# --- what the model asks of the active layout ----------------------------------------------------------


def stored_lookup_split(vocab_size: int, tokens: int) -> tuple[str, ...]:
    """Mesh axes that split the stored table's embed dim but not the activations' (FSDP), if looking up
    in the stored table pays (`stored_lookup_axes` for the active layout); () outside a layout."""
    layout = active_layout()
    if layout is None:
        return ()
    return tuple(stored_lookup_axes(vocab_size, tokens, layout.axis_sizes, layout.rules, layout.param_rules))


def pin_looked_up(x_btd: jax.Array, split: tuple[str, ...]) -> jax.Array:
    """The stored table's lookup pinned to the layout it makes its rows in: the batch over its axes but
    `split`, the embed dim over `split`. Left to propagation, the batch layout that follows was pulled
    onto the lookup, whose gradient's scatter XLA then could not partition from it (data=2,fsdp=4,
    batch 8: "involuntary full rematerialization", twice a step); pinned, the rows go between the two
    layouts by all-to-all."""
    layout = active_layout()
    batch = tuple(a for a in mesh_axes_of(layout.spec((BATCH,))[0]) if a not in split)
    spec = PartitionSpec(batch or None, layout.spec((LENGTH,))[0], split if len(split) > 1 else split[0])
    return jax.lax.with_sharding_constraint(x_btd, NamedSharding(layout.mesh, spec))


def heads_split_alike() -> bool:
    """Are heads and kv heads split over the same mesh axes, as weights and as activations?"""
    layout = active_layout()
    return layout is None or all(layout.mesh_axes(HEADS, param=param) == layout.mesh_axes(KV_HEADS, param=param)
                                 for param in (False, True))


def queries_split_like_keys() -> bool:
    """Do the attention's queries and keys/values take the same layout (cuDNN's attention needs it)?"""
    layout = active_layout()
    return layout is None or (
        layout.spec((BATCH, LENGTH, HEADS, HEAD_DIM)) == layout.spec((BATCH, LENGTH, KV_HEADS, HEAD_DIM)))
