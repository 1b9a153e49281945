"""The devices a command or run starts: XLA flags and the simulated CPU device count settled before JAX
starts, the cluster joined, the compile cache chosen. What is worth saying goes to `warn` and `note`
callables (Notice), so the caller decides how it looks. No JAX at import."""

import collections
from collections.abc import Callable
from pathlib import Path

from shard import config as config_mod
from shard.errors import ShardError
from shard.sharding.mesh import MeshSpec, devices_needed
from shard.startup.compile_cache import use_compile_cache

DEFAULT_FILL_DEVICES = 8
MAX_SIMULATED_DEVICES = 4096  # 13 s for XLA's CPU platform to start; 100,000 would take hours

Notice = Callable[[str], None]


def unsaid(message: str) -> None:
    """The default notice of a caller that shows none."""


def start_devices(cfg: config_mod.TrainConfig, mesh_spec: MeshSpec, compile_cache: Path | None = None,
                  cluster=None, *, warn: Notice = unsaid, note: Notice = unsaid):
    """Settle XLA flags and the CPU device count (per process), join the cluster if there is one, start
    JAX, and return the devices the mesh will use (every process's with --cross-host xla, this one's
    with mpi). Process 0 `warn`s of XLA flags this jaxlib doesn't know and `note`s the CPU devices it
    simulates unasked."""
    from shard.cluster import runtime
    from shard.startup import xla_flags
    from shard.startup.devices import request_host_devices

    unknown = []
    if not runtime.jax_started():
        unknown = xla_flags.apply(gpu_preset=cfg.xla.gpu_flags, deterministic=cfg.xla.deterministic)
    n_proc = cluster.num_processes if cluster else 1
    wanted = _devices_per_process(cfg, mesh_spec, n_proc)
    asked = request_host_devices(wanted)
    ctx = runtime.start(cluster, cfg.cluster.cross_host, cfg.cluster.failure_timeout, cfg.cluster.join_timeout,
                        cfg.cluster.bind)
    import jax

    from shard.startup.imports import import_flax

    import_flax()  # before the model code imports it

    if compile_cache is not None:
        use_compile_cache(compile_cache)
    devices = jax.devices() if ctx.mode != runtime.MPI else jax.local_devices()
    if unknown and ctx.is_main:  # said once, not by every process
        warn(f"warning: this XLA does not know {', '.join(unknown)} (renamed or retired in this jaxlib): left out "
             "of shard's XLA flags")
    if asked and devices[0].platform == "cpu" and wanted > 1 and ctx.is_main and not cfg.mesh.simulate_devices:
        each = f" in each of {n_proc} processes" if n_proc > 1 else ""
        note(f"simulating {wanted} CPU devices{each} (XLA host platform); set --simulate-devices to change")
    return devices


def _devices_per_process(cfg: config_mod.TrainConfig, mesh_spec: MeshSpec, n_proc: int) -> int:
    """The CPU devices each process asks for: --simulate-devices, else what the mesh needs (8 to fill)."""
    needed = devices_needed(mesh_spec, DEFAULT_FILL_DEVICES * n_proc)
    if not cfg.mesh.simulate_devices and needed % n_proc:
        raise ShardError(f"mesh {mesh_spec.describe()} needs {needed} devices, which do not split evenly "
                         f"over {n_proc} processes")
    wanted = cfg.mesh.simulate_devices or needed // n_proc
    if wanted > MAX_SIMULATED_DEVICES:
        what = f"--simulate-devices {wanted} asks for" if cfg.mesh.simulate_devices else \
            f"mesh {mesh_spec.describe()} needs {wanted} devices in one process,"
        raise ShardError(f"{what} more than the "
                         f"{MAX_SIMULATED_DEVICES} CPU devices shard simulates (XLA's start-up time grows "
                         "with the square); use `shard plan` for bigger clusters")
    return wanted


def check_devices_per_process(devices) -> None:
    """Every process of one global mesh holds as many devices (each process sees them all, so each
    says the same): unequal, the mesh can't be laid out (orbax fails deep in a reshape)."""
    counts = collections.Counter(d.process_index for d in devices)
    if len(set(counts.values())) > 1:
        held = ", ".join(f"process {p}: {n}" for p, n in sorted(counts.items()))
        raise ShardError(f"the processes hold different numbers of devices ({held}); start every process with "
                         "the same --num-processes and --simulate-devices, on hosts with as many accelerators")
