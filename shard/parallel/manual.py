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


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over inside a shard_map (jax 0.10's `manual_axis_type.varying`,
    earlier jax's `vma`)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def set_row(buf, m, value, valid):
    """Row m of `buf` set to `value` where `valid`."""
    return buf.at[m].set(jnp.where(valid, value, buf[m]))
