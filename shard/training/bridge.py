"""The MPI bridge (`--cross-host mpi`): a hierarchical all-reduce, as Horovod does it.

Each process compiles the SPMD step over its own devices (XLA collectives inside the node: NCCL on
GPUs). Gradient sums, the summed loss and the token count then cross processes through mpi4jax inside a
jitted function, flattened into a few buckets instead of one call per parameter, and every process
applies the same update. Same numerics as one global mesh, up to the order of the sums, except a MoE
model's load-balancing loss: a statistic of each process's rows, averaged over the processes.

mpi4jax refuses a jitted computation over several local devices ("ordered effects are not supported
for more than 1 device"), so:
- one device per process: the whole step is one jit, the MPI all-reduce inside it;
- several: jit 1 reduces inside the node (its outputs are replicated over the local mesh), jit 2 runs
  the MPI all-reduce on device 0's copy, the result is broadcast back to the local devices, and jit 3
  applies the update.
mpi4jax ops do not survive AOT compilation (`.lower().compile()` drops their effect token), so these
functions are called as jitted functions.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shard.config.train import PipelineConfig
from shard.errors import ShardError, first_line
from shard.sharding.rules import Layout
from shard.training.state import StateSpec
from shard.training.step import batch_sharding, make_step_parts, schedule_inputs, with_schedule

DEFAULT_BUCKET_BYTES = 64 << 20


def buckets(leaves: list, bucket_bytes: int) -> list[list[int]]:
    """Indices of consecutive same-dtype leaves grouped so each group stays under bucket_bytes (a leaf
    larger than that gets a group of its own)."""
    groups: list[list[int]] = []
    size, dtype = 0, None
    for i, leaf in enumerate(leaves):
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        if not groups or leaf.dtype != dtype or size + nbytes > bucket_bytes:
            groups.append([])
            size, dtype = 0, leaf.dtype
        groups[-1].append(i)
        size += nbytes
    return groups


def allreduce_tree(tree, comm, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Sum every leaf over `comm` (traced inside a single-device jit): one MPI all-reduce per bucket."""
    import mpi4jax
    from mpi4py import MPI

    leaves, treedef = jax.tree.flatten(tree)
    out = list(leaves)
    for group in buckets(leaves, bucket_bytes):
        flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in group])
        summed = mpi4jax.allreduce(flat, op=MPI.SUM, comm=comm)
        offset = 0
        for i in group:
            n = math.prod(leaves[i].shape)
            out[i] = summed[offset:offset + n].reshape(leaves[i].shape)
            offset += n
    return jax.tree.unflatten(treedef, out)


def make_bridge_step(spec: StateSpec, layout: Layout, comm, microbatches: int = 1,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES, pipe: PipelineConfig | None = None):
    """`(state, batch) -> (state, metrics)` over this process's local mesh, reduced across `comm`; `pipe`
    is the schedule when that mesh has pipeline stages."""
    try:
        import mpi4jax  # noqa: F401 -- checked before anything compiles
    except ImportError as e:
        if e.name != "mpi4jax":  # installed, but it cannot load (its MPI library, a JAX it was not built for)
            raise ShardError(f"--cross-host mpi: mpi4jax is installed but does not import ({first_line(e)}); "
                             "reinstall it against this MPI: pip uninstall -y mpi4jax && ./install.sh mpi") from None
        raise ShardError("--cross-host mpi needs mpi4jax: run `./install.sh mpi`, which builds it against the "
                         "installed MPI (pip install -e '.[mpi]' brings mpich and mpi4py only)") from None
    grad_sums, apply = make_step_parts(spec, layout, microbatches, pipe=pipe)
    processes = comm.Get_size()

    def across(sums):
        """Gradients, loss, token count and the experts' loads summed over the processes; the MoE
        auxiliary loss and router z-loss (means over each process's rows) averaged: summed, they were
        reported times the process count."""
        grads, nll, count, moe = allreduce_tree(sums, comm, bucket_bytes)
        return grads, nll, count, moe | {k: moe[k] / processes for k in ("aux", "z") if k in moe}

    replicated = NamedSharding(layout.mesh, PartitionSpec())
    data = batch_sharding(layout)  # every key of the batch, packed rows' included

    if layout.mesh.size == 1:
        def fused(state, batch, args):
            return apply(state, *across(grad_sums(state["params"], batch, state.get("router_bias"))), args)

        jitted = jax.jit(fused, in_shardings=(spec.shardings, data, replicated),
                         out_shardings=(spec.shardings, replicated), donate_argnums=0)
        return with_schedule(jitted, spec, layout)

    local = jax.jit(lambda state, batch: grad_sums(state["params"], batch, state.get("router_bias")),
                    in_shardings=(spec.shardings, data), out_shardings=replicated)
    cross = jax.jit(across)
    update = jax.jit(apply, in_shardings=(spec.shardings, replicated, replicated, replicated, replicated, replicated),
                     out_shardings=(spec.shardings, replicated), donate_argnums=0)

    args = schedule_inputs(spec, layout)

    def step(state, batch):
        sums = local(state, batch)
        on_first = jax.tree.map(lambda x: x.addressable_data(0), sums)
        summed = jax.device_put(cross(on_first), replicated)
        return update(state, *summed, args)

    return step
