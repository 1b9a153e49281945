"""What a layout costs, read from the compiled train step: collectives per mesh axis, memory per device,
FLOPs, and communication efficiency against the analytic minimum (shard.measure.costs).

Everything comes from the AOT-compiled step over abstract shapes (`jax.eval_shape`), so nothing is
allocated: a 13B model is analysed on a laptop's simulated devices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


from shard.measure import costs, hlo, hlo_dots
from shard.measure.flops import model_flops
from shard.axes import LENGTH, STAGE
from shard.config.train import TrainConfig
from shard.parallel.pipeline import executed_ops
from shard.parallel.schedule import build
from shard.sharding.rules import Layout
from shard.training.compiled import compile_step, memory_of


# rounding: an efficiency is reported to 4 places, and a few scalars (the loss, the token count) ride along
EFFICIENCY_SLACK = 1e-3


@dataclass(frozen=True)
class StepAnalysis:
    """The compiled step's costs, per device per step."""

    collectives: list[hlo.Collective]
    memory: dict[str, int]  # arguments, outputs, temporaries, aliased, total (bytes)
    flops: float  # from XLA's cost analysis, which counts a loop's body once (one of the scanned layers)
    model_flops: float  # analytic 6N + attention, per device
    bytes_by_axes: dict[str, float]  # logical collective bytes on the wire per mesh axis (multi-axis split)
    compiled_bytes_by_axes: dict[str, float]  # as compiled (CPU: reduce-scatter as all-reduce, ...)
    minimum_bytes_by_axes: dict[str, float]  # analytic minimum for this layout (shard.measure.costs)
    platform: str
    unmodelled_axes: dict[str, str] = field(default_factory=dict)  # axis -> parallelism, no minimum
    # the compiled step's matmul FLOPs, each loop by its trip count (shard.measure.hlo_dots): remat's
    # recompute included; a conditional's branches (the table schedules' switch) counted as if each ran.
    # None off XLA:CPU, whose HLO keeps its matmuls as dots (a GPU's calls cuBLAS by custom-calls)
    matmul_flops: float | None = None

    @property
    def efficiency(self) -> dict[str, float]:
        """Analytic minimum / logical bytes moved, per mesh axis (1.0 where nothing moves); not for the
        axes whose traffic the cost model leaves out. Never above 1 + EFFICIENCY_SLACK: a step that moves
        less than the minimum (or nothing where the minimum is not 0) means the minimum or the count is
        wrong, and is raised as the bug it is rather than reported."""
        out = {}
        for axis in sorted((set(self.bytes_by_axes) | set(self.minimum_bytes_by_axes)) - set(self.unmodelled_axes)):
            moved = self.bytes_by_axes.get(axis, 0.0)
            need = self.minimum_bytes_by_axes.get(axis, 0.0)
            out[axis] = round(need / moved, 4) if moved else (1.0 if not need else float("inf"))
            if out[axis] > 1.0 + EFFICIENCY_SLACK:
                raise AssertionError(f"axis {axis} moved {moved:,.0f} B per device, less than its analytic minimum "
                                     f"{need:,.0f} B (efficiency {out[axis]}): the cost model (shard.measure.costs) "
                                     "or the collective count (shard.measure.hlo) is wrong for this layout")
        return out

    def to_dict(self) -> dict:
        return {
            "platform": self.platform,
            "memory_per_device_bytes": self.memory["total"],
            "memory": self.memory,
            "collectives": hlo.summarize(self.collectives),
            "bytes_per_axis": {k: int(v) for k, v in self.bytes_by_axes.items()},
            "compiled_bytes_per_axis": {k: int(v) for k, v in self.compiled_bytes_by_axes.items()},
            "minimum_bytes_per_axis": {k: int(v) for k, v in self.minimum_bytes_by_axes.items()
                                       if k not in self.unmodelled_axes},
            "communication_efficiency": self.efficiency,
            "unmodelled_axes": self.unmodelled_axes,
            "efficiency_basis": "logical collectives (CPU all-reduce+slice counted as reduce-scatter, "
                                "add of two all-reduces as one, bf16 the backend widened to f32 as bf16), "
                                "ring algorithm bytes on the wire",
            "flops_per_device": self.flops,
            "model_flops_per_device": self.model_flops,
            "matmul_flops_per_device": self.matmul_flops,
        }


def analyze(cfg: TrainConfig, layout: Layout, compiled=None) -> StepAnalysis:
    """Compile (unless given) and analyse the train step of `cfg` on `layout`."""
    compiled = compiled if compiled is not None else compile_step(cfg, layout)
    names = tuple(layout.mesh.axis_names)
    sizes = tuple(layout.mesh.shape[a] for a in names)
    text = compiled.as_text()
    items = hlo.collectives(text, names, sizes)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    shape = costs.LayoutShape.from_layout(layout)
    platform = layout.mesh.devices.flat[0].platform
    work = costs.Workload.from_config(cfg, platform)
    return StepAnalysis(
        collectives=items,
        memory=memory_of(compiled),
        flops=float(cost.get("flops", 0.0)),
        model_flops=model_flops(cfg.model, work.global_batch * work.seq_len, work.seq_len,
                                      shape.degree(LENGTH)) / layout.mesh.size,
        bytes_by_axes=hlo.bytes_by_axes(items, axis_sizes=dict(zip(names, sizes))),
        compiled_bytes_by_axes=hlo.bytes_by_axes(items, logical=False, axis_sizes=dict(zip(names, sizes))),
        minimum_bytes_by_axes=costs.comm_bytes(cfg.model, shape, work),
        platform=platform,
        unmodelled_axes=_lora_unmodelled(cfg, layout) | costs.unmodelled_axes(shape, moe=bool(cfg.model.n_experts)),
        matmul_flops=float(hlo_dots.total_flops(hlo_dots.dots(text))) if platform == "cpu" else None,
    )


def _lora_unmodelled(cfg: TrainConfig, layout: Layout) -> dict[str, str]:
    """Under LoRA every axis is unmodelled: the formulas count the gradients of every weight, and only
    the adapters' are reduced (no minimum, so no efficiency, is claimed)."""
    if not cfg.lora.rank:
        return {}
    return {a: "LoRA" for a, n in layout.mesh.shape.items() if n > 1}


def table_exact_bytes(a: StepAnalysis, cfg: TrainConfig, axis_sizes: dict[str, int]) -> dict[str, float]:
    """Bytes per mesh axis of a table-schedule step (1F1B, interleaved, zero-bubble) counted as its table
    runs them, a device's average, where the compiled count takes every branch of a `lax.switch` on
    every tick: a collective in a branch of the op switch (the executor's ops: idle, forward, backward,
    ...) weighed by the share of (tick, stage) slots that run that op, and the sends (the permutes over
    stage of the send switches) as the table sends them (Schedule.sends) of the buffer they pass; the rest
    as compiled. Empty for a step without branches (GPipe, no stage axis)."""
    if STAGE not in axis_sizes or not any(c.in_branch for c in a.collectives):
        return {}
    S, pipe = axis_sizes[STAGE], cfg.pipeline
    sch = build(pipe.schedule, S, pipe.microbatches, pipe.virtual_stages)
    sends = {c.branch[0] for c in a.collectives if c.branch and c.kind == "collective-permute" and c.over == (STAGE,)}
    ops = executed_ops(sch)
    counted = [dataclasses.replace(c, count=c.count * float((ops == c.branch[1]).mean())) if c.branch else c
               for c in a.collectives if not (c.branch and c.branch[0] in sends)]
    out = hlo.bytes_by_axes(counted, axis_sizes=axis_sizes)
    passed = [c for c in a.collectives if c.branch and c.branch[0] in sends]
    if passed:
        n = sum(len(f) + len(b) for f, b in sch.sends())
        out[STAGE] = out.get(STAGE, 0.0) + n * max(c.result_bytes for c in passed) / S
    return out
