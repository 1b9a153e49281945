"""Which sizes an elastic job may run at: a process count between the job's bounds whose devices the mesh
fills (its one -1 axis takes what the others leave) and over whose data-parallel devices the global batch
divides, so the batch and the data order stay what they were at every size. Pure Python, no JAX."""

import math
from dataclasses import dataclass

from shard.axes import BATCH
from shard.errors import ShardError
from shard.sharding.mesh import FILL, MeshSpec, resolve_shape


@dataclass(frozen=True)
class SizePolicy:
    """`mesh` with one FILL axis, `devices_per_process` devices in each process, `batch` rows a global
    batch in `microbatches`, the rules that place `batch` (the mesh's, amended by the config's), and the
    job's bounds."""

    mesh: MeshSpec
    devices_per_process: int
    batch: int
    microbatches: int
    batch_axes: tuple[str, ...]
    min_processes: int
    max_processes: int

    @classmethod
    def of(cls, mesh: MeshSpec, rules: dict, devices_per_process: int, batch: int, microbatches: int,
           min_processes: int, max_processes: int) -> "SizePolicy":
        """The policy of a config's mesh and batch; a mesh without exactly one -1 axis, or bounds that
        make no sense, are refused in one line."""
        if mesh.shape.count(FILL) != 1:
            raise ShardError(f"shard launch needs a mesh with one -1 axis, the one that grows and shrinks with the "
                             f"job (data=-1,model=2); got {mesh.describe()}")
        if devices_per_process < 1:
            raise ShardError(f"--devices-per-process must be 1 or more, got {devices_per_process}")
        if not 1 <= min_processes <= max_processes:
            raise ShardError(f"the job's sizes must satisfy 1 <= --min-processes ({min_processes}) <= "
                             f"--max-processes ({max_processes})")
        batch_axes = tuple((mesh.rules | rules).get(BATCH, ()))
        return cls(mesh, devices_per_process, batch, microbatches, batch_axes, min_processes, max_processes)

    def shape(self, processes: int) -> tuple[int, ...]:
        return resolve_shape(self.mesh, processes * self.devices_per_process)

    def describe(self, processes: int) -> str:
        """The mesh at that size, as `data=3,model=2`."""
        return self.mesh.describe(self.shape(processes))

    def problem(self, processes: int) -> str:
        """Why the job can't run on `processes` processes ("" where it can)."""
        if not self.min_processes <= processes <= self.max_processes:
            return f"{processes} is outside {self.min_processes}..{self.max_processes} processes"
        try:
            shape = self.shape(processes)
        except ShardError as e:
            return str(e)
        sizes = dict(zip(self.mesh.axes, shape))
        ways = math.prod(sizes.get(a, 1) for a in self.batch_axes)
        if self.batch % (ways * self.microbatches):
            return (f"the global batch {self.batch} does not divide over the {ways} data-parallel devices of "
                    f"{self.mesh.describe(shape)}" + (f" in {self.microbatches} microbatches" if self.microbatches > 1
                                                       else ""))
        return ""

    def largest(self, available: int) -> int:
        """The most processes the job can run on with `available` process slots; a ShardError saying why
        none fits."""
        for n in range(min(available, self.max_processes), self.min_processes - 1, -1):
            if not self.problem(n):
                return n
        if available < self.min_processes:
            raise ShardError(f"{available} process slot(s) left, fewer than --min-processes {self.min_processes}")
        reasons = "; ".join(f"{n}: {self.problem(n)}" for n in range(min(available, self.max_processes),
                                                                     self.min_processes - 1, -1))
        raise ShardError(f"no size between {self.min_processes} and {min(available, self.max_processes)} processes "
                         f"fits the job ({reasons})")
