"""Horovod-style process sets: named groups of a job's processes, each with a sub-mesh over its members'
devices and, where MPI runs, a sub-communicator. The evaluator runs on one (shard.training.evaluate), and
the MPI bridge reduces gradients over `world()`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from shard.cluster.exchange import gather_text
from shard.cluster.mpi import mpi_available, mpi_world
from shard.cluster.runtime import MPI, XLA, Context, context
from shard.errors import ShardError


class ProcessSet:
    """A named group of processes, as in Horovod: a sub-mesh over its members' devices and, where MPI
    runs, a sub-communicator. Collectives on a set involve its members only; non-members skip them.

    Create with `process_set(ranks)` on every process (non-members get a handle that says so), destroy
    with `.destroy()`; a destroyed set raises ShardError when used.
    """

    def __init__(self, name: str, ranks: Sequence[int], ctx: Context):
        self.name, self.ranks, self._ctx = name, tuple(ranks), ctx
        self._alive = True
        self._comm = None
        if ctx.mode == MPI or (ctx.mode != "single" and mpi_available()):
            world = mpi_world()
            # MPI_Comm_create_group is collective over the members only.
            group = world.Get_group().Incl(list(self.ranks))
            self._comm = world.Create_group(group) if self.includes(ctx.rank) else None
            group.Free()

    def __repr__(self) -> str:
        state = "" if self._alive else ", destroyed"
        return f"ProcessSet({self.name!r}, ranks={list(self.ranks)}{state})"

    def includes(self, rank: int | None = None) -> bool:
        """Whether `rank` (default: this process) is a member."""
        return (self._ctx.rank if rank is None else rank) in self.ranks

    @property
    def rank(self) -> int:
        """This process's position in the set (0 is the set's leader)."""
        self._check()
        return self.ranks.index(self._ctx.rank)

    @property
    def size(self) -> int:
        self._check()
        return len(self.ranks)

    @property
    def comm(self):
        """The MPI sub-communicator (members only)."""
        self._check()
        if self._comm is None:
            raise ShardError(f"process set {self.name!r} has no MPI communicator here "
                             "(MPI is not running, or this process is not a member)")
        return self._comm

    def devices(self) -> list:
        """The devices of the member processes (with the MPI bridge, each process sees only its own)."""
        self._check()
        import jax

        if self._ctx.mode == XLA:
            return [d for d in jax.devices() if d.process_index in self.ranks]
        return list(jax.local_devices())

    def mesh(self, spec: str = "data=-1"):
        """A shard mesh (any `--mesh` spec) over the members' devices, processes on the outer axes."""
        from shard.sharding.mesh import build_mesh, parse_mesh

        self._check()
        return build_mesh(parse_mesh(spec), sorted(self.devices(), key=lambda d: (d.process_index, d.id)))

    def allreduce(self, x) -> np.ndarray:
        """The sum of `x` (a host array or scalar) over the members; every member gets it."""
        self._check()
        if not self.includes():
            raise ShardError(f"process {self._ctx.rank} is not a member of process set {self.name!r} "
                             f"(ranks {list(self.ranks)})")
        x = np.asarray(x)
        if self._ctx.mode == "single":
            return x.copy()
        if self._comm is not None:
            out = np.empty_like(x)
            self._comm.Allreduce(np.ascontiguousarray(x), out)
            return out
        return self._xla_allreduce(x)

    def _xla_allreduce(self, x: np.ndarray) -> np.ndarray:
        """One row per member on the set's own devices (first local device of each member), summed
        by an XLA program that only the members run."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

        firsts = {}
        for d in sorted(self.devices(), key=lambda d: d.id):
            firsts.setdefault(d.process_index, d)
        mesh = Mesh(np.array([firsts[r] for r in sorted(firsts)]), ("procs",), axis_types=(AxisType.Auto,))
        rows = jax.make_array_from_callback((len(firsts), *x.shape), NamedSharding(mesh, PartitionSpec("procs")),
                                            lambda index: x[None])
        total = jax.jit(lambda r: jnp.sum(r, axis=0), out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)
        return np.asarray(total.addressable_data(0))

    def destroy(self) -> None:
        """Remove the set; further use raises ShardError."""
        if self._alive:
            self._alive = False
            if self._comm is not None:
                self._comm.Free()
                self._comm = None
            self._ctx.sets.pop(self.name, None)

    def _check(self) -> None:
        if not self._alive:
            raise ShardError(f"process set {self.name!r} was destroyed")


def process_set(ranks: Sequence[int], name: str | None = None, *, _compare: bool = True) -> ProcessSet:
    """Create a process set over `ranks` (call it on every process, with the same ranks: the processes
    compare them first, since MPI would wait for ever on a group its members disagree about)."""
    ctx = context()
    given = [int(r) for r in ranks]
    ranks = tuple(sorted(set(given)))
    if len(ranks) < len(given):
        raise ShardError(f"process set ranks repeat: {given}")
    if not ranks or ranks[0] < 0 or ranks[-1] >= ctx.size:
        raise ShardError(f"process set ranks must be in 0..{ctx.size - 1}, got {list(ranks)}")
    name = name or "ranks-" + "-".join(map(str, ranks))
    if _compare:
        asked = [json.loads(t) for t in gather_text(json.dumps([name, list(ranks)]))]
        other = next((p for p, a in enumerate(asked) if a != asked[0]), None)
        if other is not None:
            raise ShardError(f"process {other} created process set {asked[other][0]!r} over ranks {asked[other][1]}, "
                             f"process 0 {asked[0][0]!r} over {asked[0][1]}; create a set on every process with "
                             "the same ranks and name")
    if name in ctx.sets:
        raise ShardError(f"process set {name!r} already exists; destroy it first")
    ps = ProcessSet(name, ranks, ctx)
    ctx.sets[name] = ps
    return ps


def world() -> ProcessSet:
    """The set of every process (created on first use)."""
    ctx = context()
    return ctx.sets.get("world") or process_set(range(ctx.size), "world", _compare=False)  # alike everywhere
