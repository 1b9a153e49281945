"""Checksums of a train state's arrays, computed on the devices or on the host: saved with each
checkpoint and compared when it is read back, so damaged data is not trained on."""

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shard.sharding.rules import path_str


def state_fingerprint(state) -> dict[str, list]:
    """`{leaf path: [checksum, dtype]}` of a (sharded) state, computed where the arrays are: a leaf's
    checksum is the sum of its bit patterns weighted by odd multipliers of their position, modulo 2**32.
    Any one flipped bit changes it, and it does not depend on the sharding (integer sums are exact in
    any order). Saved with each checkpoint and compared on restore, for the leaves read back in the dtype
    they were saved in: a stored chunk damaged in a way that still decompresses is caught instead of
    trained on."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    first = leaves[0][1].sharding if leaves and isinstance(leaves[0][1], jax.Array) else None
    replicated = NamedSharding(first.mesh, PartitionSpec()) if isinstance(first, NamedSharding) else None
    # one leaf at a time: XLA:CPU materialises each leaf's weighted bits before summing them, and in one
    # program every leaf's at once (a second copy of the state: 1 GiB of temporaries for a 1 GiB state)
    one = _fingerprint(replicated)
    sums = [np.asarray(one(x).addressable_data(0)) for _, x in leaves]
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


@functools.cache
def _fingerprint(out_sharding):
    import jax.numpy as jnp

    def one(x):
        x = jnp.asarray(x)
        if x.dtype == jnp.bool_:
            bits = x.astype(jnp.uint32)
        else:
            unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
            bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)  # 8 bytes: a last dim of 2
        index, stride = jnp.zeros(bits.shape, jnp.uint32), 1
        for d in reversed(range(bits.ndim)):
            index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d) * jnp.uint32(stride % (1 << 32))
            stride *= bits.shape[d]
        return jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32)

    return jax.jit(one, out_shardings=out_sharding)
