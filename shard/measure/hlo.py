"""Collectives in optimized HLO text: what each moves, how often, and over which mesh axes.

Pure text processing (no JAX): `collectives(text, axis_names, axis_sizes)` reads `compiled.as_text()`:
every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute, including the async
`-start` forms, combined ones too (the matching `-done` is not counted again), with its mesh axes
(hlo_groups) and how many times it runs (hlo_text). A CPU reduce-scatter (hlo_reduce_scatter) is
reported as compiled (`all-reduce`) and as the logical collective (`reduce-scatter`); one XLA:CPU widened
(a bf16 gradient reduced in f32) is counted on the program's type, and its `compiled_as` says so.

Bytes on the wire per device follow the ring algorithms nccl-tests assumes: all-reduce 2(n-1)/n x S,
all-gather (n-1)/n x S_out, reduce-scatter (n-1)/n x S_in, all-to-all (n-1)/n x S, permute S x the share
of devices that send (a pipeline's chain of stages: (S-1)/S; a ring: 1), a device's average. A ragged
all-to-all (GPU, TPU) is an all-to-all of its receive buffer: an upper bound, since it sends only the
rows routed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from shard.measure.costs import axis_share, wire_bytes
from shard.measure.hlo_groups import devices_over, group_axes, groups_of, permute_pairs
from shard.measure.hlo_reduce_scatter import program_bytes, split_reduce_scatter
from shard.measure.hlo_text import array_bytes, element_shapes, multiplicities, parse_module, tuple_elements

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled program (per device, per execution)."""

    name: str
    kind: str  # the logical collective: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    compiled_as: str  # the op in the HLO; "all-reduce+dynamic-slice" for a CPU reduce-scatter, with
    # ", bf16 widened to f32" where the backend reduced the program's bf16 in f32
    axes: tuple[str, ...]  # mesh axes the group spans (empty: one device, no traffic)
    group_size: int
    count: int  # executions per step (loop trip counts applied)
    result_bytes: int  # the buffer the op produces (for a CPU reduce-scatter: the full all-reduce)
    wire_bytes: float  # bytes one device sends per execution, as compiled
    logical_wire_bytes: float  # bytes one device sends per execution, for the logical collective (its dtype)
    logical_axes: tuple[str, ...] | None = None  # the logical collective's axes, where not `axes` (folded)
    branch: tuple[str, int] | None = None  # in a branch: the (outermost) conditional and the branch's index

    @property
    def in_branch(self) -> bool:
        """In a conditional's branch: `count` is an upper bound (see hlo_text.multiplicities)."""
        return self.branch is not None

    @property
    def upper_bound(self) -> bool:
        """The bytes or count are a bound: a conditional's branches counted as if each ran, or a ragged
        all-to-all counted by its receive buffer (it sends only the rows routed, known at run time)."""
        return self.in_branch or self.compiled_as.startswith("ragged-all-to-all")

    @property
    def over(self) -> tuple[str, ...]:
        """Mesh axes of the logical collective."""
        return self.axes if self.logical_axes is None else self.logical_axes


def _base_kind(opcode: str) -> str | None:
    op = opcode.removesuffix("-start")
    if op == "ragged-all-to-all":  # GPU, TPU: sized by the routing at run time (shard.parallel.ragged)
        return "all-to-all"
    return op if op in KINDS else None


def collectives(text: str, axis_names: tuple[str, ...], axis_sizes: tuple[int, ...]) -> list[Collective]:
    """Every collective of an optimized HLO module, with its mesh axes, count and bytes per device."""
    comps, entry = parse_module(text)
    by_name = {c.name: c for c in comps}
    mult, in_branch = multiplicities(comps, entry)
    n_devices = math.prod(axis_sizes)
    out: list[Collective] = []
    for comp in comps:
        count = mult.get(comp.name, 0)
        if not count:
            continue
        summed: list[tuple] = []  # the all-reduced elements met so far in this computation (see below)
        continued: dict[tuple, tuple] = {}  # (all-reduce, element) -> axes an earlier one reduced it over
        for ins in comp.instrs.values():
            kind = _base_kind(ins.opcode)
            if kind is None:
                continue
            pairs = permute_pairs(ins.attrs) if kind == "collective-permute" else None
            groups = pairs or groups_of(ins, n_devices)
            axes = group_axes(groups, axis_names, axis_sizes)
            n = (2 if axes else 1) if kind == "collective-permute" else max(len(g) for g in groups)
            sizes = array_bytes(ins.shape)
            if ins.opcode.endswith("-start") and kind in ("all-gather", "collective-permute") and len(sizes) > 1:
                # all-gather: (inputs, outputs); permute: (inputs, outputs, context scalars); both nested when
                # XLA combined several, as ((in1, in2), (out1, out2), ...): the outputs are counted
                sizes = array_bytes(tuple_elements(ins.shape)[1])
            if kind == "reduce-scatter":
                sizes = [s * n for s in sizes]  # ring traffic scales with the input, n x the output
            if kind == "all-reduce" and n > 1:
                split = split_reduce_scatter(comp, ins, n, by_name, summed, axes, continued, axis_names, axis_sizes)
                for (logical, compiled_as, m, over), part in split.items():
                    total, moved = sum(s for s, _ in part), sum(s for _, s in part)  # compiled, program's dtype
                    k = devices_over(over, axis_names, axis_sizes)
                    out.append(Collective(ins.name, logical, compiled_as, axes, n, count, total,
                                          wire_bytes("all-reduce", total, n), _logical_bytes(logical, moved, k, m),
                                          None if over == axes else over, in_branch.get(comp.name)))
                continue
            total, moved, note = sum(sizes), sum(sizes), ""
            if not ins.opcode.endswith("-start"):  # widened by the backend: the program moves its own type
                shapes = element_shapes(ins.shape)
                read = [program_bytes(comp, ins.name, i if len(shapes) > 1 else None, s, by_name)
                        for i, s in enumerate(shapes)]
                moved = sum(b for b, _ in read) * (n if kind == "reduce-scatter" else 1)
                note = next((t for _, t in read if t), "")
            w = wire_bytes(kind, total, n)
            share = min(len(pairs), n_devices) / n_devices if pairs else 1.0  # permute: one sender a pair
            out.append(Collective(ins.name, kind, ins.opcode + note, axes, n, count, total, w * share,
                                  wire_bytes(kind, moved, n) * share, branch=in_branch.get(comp.name)))
    return out


def _logical_bytes(logical: str, size: int, n: int, kept: int | None) -> float:
    """Bytes of the logical collective: an all-reduce over n devices that each keep 1/m of it is a
    reduce-scatter over m and an all-reduce of the 1/m part over the other n/m (FSDP's shard of a
    gradient that data parallel also reduces)."""
    if kept is None:  # summed into an earlier element before use: counted there
        return 0.0
    if logical == "all-reduce":
        return wire_bytes("all-reduce", size, n)
    return wire_bytes("reduce-scatter", size, kept) + wire_bytes("all-reduce", size / kept, n // kept)


def summarize(items: list[Collective]) -> list[dict]:
    """Collectives grouped by (logical kind, axes): count and bytes per device per step."""
    table: dict[tuple, dict] = {}
    for c in items:
        if not c.axes:
            continue
        key = (c.kind, c.over, c.compiled_as)
        row = table.setdefault(key, {"kind": c.kind, "axes": list(c.over), "compiled_as": c.compiled_as,
                                     "count": 0, "bytes_per_device": 0.0, "compiled_bytes_per_device": 0.0,
                                     "upper_bound": False})
        row["count"] += c.count
        row["upper_bound"] |= c.upper_bound
        row["bytes_per_device"] += c.logical_wire_bytes * c.count
        row["compiled_bytes_per_device"] += c.wire_bytes * c.count
    rows = sorted(table.values(), key=lambda r: (-r["bytes_per_device"], r["kind"]))
    for r in rows:
        r["bytes_per_device"] = round(r["bytes_per_device"])
        r["compiled_bytes_per_device"] = round(r["compiled_bytes_per_device"])
    return rows


def bytes_by_axes(items: list[Collective], logical: bool = True,
                  axis_sizes: dict[str, int] | None = None) -> dict[str, float]:
    """Wire bytes per device per step by mesh axis. A collective over several axes at once is keyed
    "data+fsdp", or, given the axis sizes, split between its axes in proportion to (n - 1). Logical
    bytes go to the logical collective's axes (two all-reduces in a row: both's)."""
    out: dict[str, float] = defaultdict(float)
    for c in items:
        if not c.axes:
            continue
        b = (c.logical_wire_bytes if logical else c.wire_bytes) * c.count
        axes = c.over if logical else c.axes
        if axis_sizes is None or len(axes) == 1:
            out["+".join(axes)] += b
            continue
        sizes = {a: axis_sizes[a] for a in axes}
        for a in axes:
            out[a] += b * axis_share(sizes, a)
    return dict(out)
