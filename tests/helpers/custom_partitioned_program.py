"""Compile a custom-partitioned program (as cuDNN's attention is) over 2 CPU devices with shard's
compilation cache in CACHE_DIR (used by tests/test_compile_cache.py).

    python custom_partitioned_program.py CACHE_DIR
"""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shard.startup.compile_cache import use_compile_cache


@custom_partitioning
def double(x):
    return 2 * x


def partition(mesh, arg_shapes, result_shape):
    sharding = arg_shapes[0].sharding
    return mesh, lambda x: 2 * x, sharding, (sharding,)


double.def_partition(partition=partition, infer_sharding_from_operands=lambda mesh, args, result: args[0].sharding,
                     sharding_rule="i -> i")

use_compile_cache(Path(sys.argv[1]))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
mesh = jax.make_mesh((2,), ("d",))
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
print(jax.jit(double)(x).sum())
