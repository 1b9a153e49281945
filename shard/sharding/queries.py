"""What the model asks of the layout its step is traced under (`activation_layout`): which lookup reads
the stored table, the layout its rows are pinned to, whether heads, kv heads and queries split alike,
and for routing tokens to experts device by device, which mesh axes split the tokens and the experts
and on which platform. Mesh axes stay here, beside `constrain`, so the model code names logical axes
only.
"""

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shard.axes import BATCH, EXPERT, HEAD_DIM, HEADS, KV_HEADS, LENGTH, RES_LENGTH
from shard.config.model import ModelConfig
from shard.sharding.decisions import head_vocab_split_axes, stored_lookup_axes
from shard.sharding.rules import active_layout, mesh_axes_of


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


def head_vocab_split(cfg: ModelConfig, tokens: int, chunks: int) -> tuple[str, ...]:
    """Mesh axes over which the head's loss splits the vocabulary instead of the batch
    (`head_vocab_split_axes` for the active layout), outside a shard_map; () outside a layout."""
    layout = active_layout()
    if layout is None or jax.sharding.get_abstract_mesh().manual_axes:
        return ()
    return tuple(head_vocab_split_axes(cfg, tokens, layout.axis_sizes, layout.rules, layout.param_rules, chunks))


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


def auto_ways(logical: str) -> int:
    """How many ways the active layout splits `logical` over mesh axes still automatic here (inside the
    pipeline's shard_map some are manual: their shares are already local); 1 outside a layout."""
    layout = active_layout()
    if layout is None:
        return 1
    inner = jax.sharding.get_abstract_mesh()
    manual = set(inner.manual_axes) if not inner.empty else set()
    return math.prod(layout.axis_sizes[a] for a in layout.mesh_axes(logical) if a not in manual)


def token_axes() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes that split the residual stream's batch and length in the layout being traced, for
    MoE routing's per-device shard_maps (shard.parallel.expert_exchange). None outside a layout, or
    inside another shard_map (pipeline stages), where the partitioner places the routing as it would
    any op."""
    layout = active_layout()
    if layout is None or jax.sharding.get_abstract_mesh().manual_axes:
        return (), ()
    batch = layout.mesh_axes(BATCH)
    return batch, tuple(a for a in layout.mesh_axes(RES_LENGTH) if a not in batch)


def expert_split_axes(token_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes that split the experts, when each of them also splits the tokens (`ep`: expert is
    a batch axis outside the MoE layers): dropless routing then moves tokens to the experts. Experts
    split over an axis that holds the same tokens stay gathered at the shard_map's boundary."""
    experts = active_layout().mesh_axes(EXPERT)
    return experts if experts and set(experts) <= set(token_axes) else ()


def layout_platform() -> str:
    """The platform of the active layout's devices ("cpu", "gpu", "tpu"): whether it lowers a ragged
    all-to-all is shard.hardware.lowers_ragged_all_to_all's to say."""
    return active_layout().mesh.devices.flat[0].platform
