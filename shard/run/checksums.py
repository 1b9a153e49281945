"""Checksums of a train state's arrays, computed on the devices or on the host: saved with each
checkpoint and compared when it is read back, so damaged data is not trained on."""

import functools
import math

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shard.sharding.rules import mesh_axes_of, path_str, spec_entries


def state_fingerprint(state, slice_elements: int = 1 << 22) -> dict[str, list]:
    """`{leaf path: [checksum, dtype]}` of a (sharded) state, computed where the arrays are: a leaf's
    checksum is the sum of its bit patterns weighted by odd multipliers of their position, modulo 2**32.
    Any one flipped bit changes it, and it does not depend on the sharding (integer sums are exact in
    any order). Saved with each checkpoint and compared on restore, for the leaves read back in the dtype
    they were saved in: a stored chunk damaged in a way that still decompresses is caught instead of
    trained on. Each device sums its own shard `slice_elements` at a time (rows of its leading dim; 16 MB
    of uint32 by default), so the sum holds no temporary the size of a leaf."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    # one leaf at a time, each its own small program: a sum of every leaf in one would hold them all
    sums = [np.asarray(_leaf_fingerprint(x, slice_elements).addressable_data(0)) for _, x in leaves]
    return {path_str(p): [int(c), str(x.dtype)] for (p, x), c in zip(leaves, sums, strict=True)}


def first_mismatch(saved: dict, read: dict) -> str | None:
    """The first leaf path whose checksum differs between two fingerprints, among the leaves both hold
    in the same dtype (a resume may cast, say to another model.param_dtype); None when all agree."""
    return next((path for path, (checksum, dtype) in read.items()
                 if path in saved and saved[path][1] == dtype and saved[path][0] != checksum), None)


def host_fingerprint(x: np.ndarray, block: int = 1 << 24) -> int:
    """One leaf's checksum (`state_fingerprint`) on the host (numpy), in blocks of `block` elements."""
    x = np.ascontiguousarray(x)
    flat = (x.astype(np.uint32) if x.dtype == np.bool_ else x.view(f"u{min(x.dtype.itemsize, 4)}")).reshape(-1)
    odd = np.arange(min(block, flat.size), dtype=np.uint32) * np.uint32(2) + np.uint32(1)  # 2 * index + 1
    total = 0
    for start in range(0, flat.size, block):
        part = flat[start:start + block].astype(np.uint32)
        weights = odd[:part.size] + np.uint32(2 * start % (1 << 32))  # wraps as the device's uint32 does
        total = (total + int(np.sum(part * weights, dtype=np.uint32))) % (1 << 32)
    return total


def _leaf_fingerprint(x, slice_elements: int) -> jax.Array:
    """One leaf's checksum as a replicated uint32, computed where the leaf is: a NamedSharding's shards
    each on their own device (nothing gathered), their sums added over the mesh axes that split it."""
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.Array) and isinstance(sharding, NamedSharding):
        return _sharded(sharding.mesh, sharding.spec, x.ndim, slice_elements)(x)
    return _whole(slice_elements)(x)


@functools.cache
def _sharded(mesh, spec: PartitionSpec, ndim: int, slice_elements: int):
    """The checksum of a leaf of `ndim` dims sharded by `spec` over `mesh`: each device sums its own block
    at its global element positions, then one exact uint32 sum over the axes that split the leaf."""
    dims = [mesh_axes_of(a) for a in spec_entries(spec, ndim)]
    split = tuple(a for axes in dims for a in axes)

    def local(block):
        offsets = [jax.lax.axis_index(axes) * n if axes else 0 for axes, n in zip(dims, block.shape, strict=True)]
        whole = tuple(n * math.prod(mesh.shape[a] for a in axes) for axes, n in zip(dims, block.shape, strict=True))
        total = _block_sum(block, offsets, whole, slice_elements)
        return jax.lax.psum(total, split) if split else total

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec(*spec), out_specs=PartitionSpec(),
                                 check_vma=False))


@functools.cache
def _whole(slice_elements: int):
    """The checksum of a leaf on one device (or a host array): its block is the whole of it."""
    return jax.jit(lambda x: _block_sum(x, [0] * x.ndim, x.shape, slice_elements))


def _block_sum(block, offsets, shape, slice_elements: int) -> jax.Array:
    """Σ bits * (2 * global flat index + 1) mod 2**32 over a block of a leaf of global `shape` starting
    at `offsets` (ints or traced), `slice_elements` at a time (rows of the leading dim; a leaf of 8-byte
    elements is summed as uint32 pairs, a last dim of 2 as the host's view)."""
    import jax.numpy as jnp

    def bits(x):
        if x.dtype == jnp.bool_:
            return x.astype(jnp.uint32)
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)

    wide = block.dtype.itemsize == 8
    shape, offsets = (*shape, 2) if wide else tuple(shape), [*offsets, 0] if wide else list(offsets)
    strides = [math.prod(shape[d + 1:]) % (1 << 32) for d in range(len(shape))]
    if block.ndim == 0 or block.size == 0:
        return bits(block).sum(dtype=jnp.uint32)
    row_shape = (*block.shape[1:], 2) if wide else block.shape[1:]
    # the position of each element of a row (every dim but the first), a row's worth of uint32
    inner = jnp.zeros(row_shape, jnp.uint32)
    for d in range(1, len(shape)):
        at = jax.lax.broadcasted_iota(jnp.uint32, row_shape, d - 1) + jnp.asarray(offsets[d], jnp.uint32)
        inner = inner + at * jnp.uint32(strides[d])
    n = block.shape[0]
    rows = max(1, min(n, slice_elements // max(1, math.prod(row_shape))))

    def add(i, total):
        start = jnp.minimum(i * rows, n - rows)  # the last slice moved back to end at n: its rows counted
        part = jax.lax.dynamic_slice_in_dim(block, start, rows)  # before (below i * rows) are masked out
        row = start + jnp.arange(rows, dtype=jnp.int32)
        fresh = (row >= i * rows).reshape((rows,) + (1,) * len(row_shape))
        lead = (row.astype(jnp.uint32) + jnp.asarray(offsets[0], jnp.uint32)) * jnp.uint32(strides[0])
        index = lead.reshape((rows,) + (1,) * len(row_shape)) + inner
        weighted = jnp.where(fresh, bits(part) * (2 * index + 1), jnp.uint32(0))
        return total + weighted.sum(dtype=jnp.uint32)

    return jax.lax.fori_loop(0, -(-n // rows), add, jnp.uint32(0))
