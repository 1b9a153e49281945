"""JAX's private API (`jax._src`) as shard.cluster uses it: the runtime `jax.distributed` starts (the
coordination service's client, process 0's service), JAX's launcher detection, and whether its backends
have started. Every use of it in the cluster room is here, below the modules that need it (coordinator,
join, runtime, exchange), so that a JAX release that moves it is met in one place.
"""

import os

from shard.errors import ShardError


def jax_distributed_module():
    """`jax._src.distributed`: the runtime `jax.distributed.initialize` starts (the coordination
    service's client, process 0's service, and the jaxlib entry point that starts a service)."""
    from jax._src import distributed

    return distributed


def service_client():
    """The client of the coordination service of the job this process joined (barriers, a key-value
    store, the live processes)."""
    return jax_distributed_module().global_state.client


def detected_cluster(method: str | None, timeout: int) -> tuple[str, int, int, list[int] | None]:
    """(coordinator address, process count, this process's id, local device ids) as JAX's launcher
    detection finds them (`method`: "mpi4py", or None for the environment's: SLURM); JAX_COORDINATOR_ADDRESS
    and JAX_COORDINATOR_PORT win, as in `jax.distributed.initialize`."""
    from jax._src import clusters

    found = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        os.environ.get("JAX_COORDINATOR_ADDRESS"), None, None, None, method, timeout)
    if None in found[:3]:
        raise ShardError("the launcher's environment names no coordinator, process count or process id")
    return found


def backends_started() -> bool:
    """Whether JAX's backends have started (imports JAX: ask only where it is imported already)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()
