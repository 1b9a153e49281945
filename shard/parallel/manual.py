"""Helpers for code inside a `jax.shard_map` that is manual over mesh axes (the pipeline schedules)."""

import jax
import jax.numpy as jnp
from jax import lax

from shard.axes import STAGE


def vary(tree, axes=(STAGE,)):
    """Mark every leaf as varying over `axes`, which must be axes it does not vary over yet (the
    callers know: an input varies over the manual axes its in_spec splits it on, a constant over none)."""
    if not axes:
        return tree
    return jax.tree.map(lambda x: lax.pcast(x, tuple(axes), to="varying"), tree)


def set_row(buf, m, value, valid):
    """Row m of `buf` set to `value` where `valid`."""
    return buf.at[m].set(jnp.where(valid, value, buf[m]))
