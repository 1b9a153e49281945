"""Collectives in optimized HLO text: what each moves, how often, and over which mesh axes.

Pure text processing (no JAX): `collectives(text, axis_names, axis_sizes)` reads `compiled.as_text()`.
No maintained Python parser of HLO text ships with JAX, and the protobuf route needs XLA's proto
definitions, so this reads the handful of things it needs with regular expressions:

- every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute, including the
  async `-start` forms, combined ones too (the matching `-done` is not counted again);
- how many times it runs: computations called from a `while` run `known_trip_count` times (layers
  are scanned, so a per-layer collective appears once in the loop body);
- its replica groups, in any of the three printed forms (`{{0,1},{2,3}}`, the iota form
  `[2,4]<=[8]T(1,0)`, and the mesh form `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`), turned into the
  names of the mesh axes along which the group's devices differ;
- the CPU lowering of a reduce-scatter: an all-reduce whose result is read only through dynamic
  slices of 1/n of it (or of 1/m: a reduce-scatter over m devices and an all-reduce over the rest).
  It is reported as compiled (`all-reduce`) and as the logical collective (`reduce-scatter`).

Bytes on the wire per device follow the ring algorithms nccl-tests assumes: all-reduce 2(n-1)/n x S,
all-gather (n-1)/n x S_out, reduce-scatter (n-1)/n x S_in, all-to-all (n-1)/n x S, permute S x the share
of devices that send (a pipeline's chain of stages: (S-1)/S; a ring: 1), a device's average.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from shard.measure.costs import axis_share, wire_bytes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}

_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclass
class Instr:
    name: str
    shape: str  # the printed result shape, a tuple "(f32[2], s32[])" or one array "f32[2,3]{1,0}"
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operand list


@dataclass
class Computation:
    name: str
    instrs: dict[str, Instr] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    params: dict[int, str] = field(default_factory=dict)  # parameter number -> instruction name


@dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled program (per device, per execution)."""

    name: str
    kind: str  # the logical collective: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    compiled_as: str  # the op in the HLO; "all-reduce+dynamic-slice" for a CPU reduce-scatter
    axes: tuple[str, ...]  # mesh axes the group spans (empty: one device, no traffic)
    group_size: int
    count: int  # executions per step (loop trip counts applied)
    result_bytes: int  # the buffer the op produces (for a CPU reduce-scatter: the full all-reduce)
    wire_bytes: float  # bytes one device sends per execution, as compiled
    logical_wire_bytes: float  # bytes one device sends per execution, for the logical collective
    in_branch: bool = False  # in a conditional's branch: `count` is an upper bound (see multiplicities)
    logical_axes: tuple[str, ...] | None = None  # the logical collective's axes, where not `axes` (folded)

    @property
    def over(self) -> tuple[str, ...]:
        """Mesh axes of the logical collective."""
        return self.axes if self.logical_axes is None else self.logical_axes


def array_bytes(shape_text: str) -> list[int]:
    """Bytes of each array in a printed shape (one entry, or one per tuple element)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype not in DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(n * DTYPE_BYTES[dtype])
    return out


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group that opens at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth, closer = 0, pairs[text[start]]
    opener = text[start]
    for i in range(start, len(text)):
        c = text[i]
        if c == opener:
            depth += 1
        elif c == closer:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _parse_instr(name: str, rhs: str) -> Instr | None:
    if rhs.startswith("("):
        end = _balanced(rhs, 0)
        shape, rest = rhs[:end], rhs[end:].lstrip()
    else:
        shape, _, rest = rhs.partition(" ")
    m = re.match(r"([a-z][a-z0-9-]*)\(", rest)
    if not m:
        return None
    opcode = m.group(1)
    open_at = m.end() - 1
    close_at = _balanced(rest, open_at)
    operands = re.findall(r"%([^\s,()]+)", rest[open_at:close_at])
    return Instr(name, shape, opcode, operands, rest[close_at:])


def parse_module(text: str) -> tuple[list[Computation], str]:
    """Computations in printed order (callees before callers) and the name of the entry computation."""
    comps: list[Computation] = []
    entry = ""
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = Computation(m.group(2))
                if m.group(1):
                    entry = current.name
            continue
        if line.startswith("}"):
            comps.append(current)
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        ins = _parse_instr(m.group(1), m.group(2))
        if ins is None:
            continue
        current.instrs[ins.name] = ins
        current.order.append(ins.name)
        if ins.opcode == "parameter":
            pm = re.match(r"\s*(\d+)", m.group(2).split("parameter(", 1)[1])
            if pm:
                current.params[int(pm.group(1))] = ins.name
    return comps, entry


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(key + r"=\{([^}]*)\}", attrs)
    if m:
        return re.findall(r"%([^\s,}]+)", m.group(1))
    m = re.search(key + r"=%([^\s,]+)", attrs)
    return [m.group(1)] if m else []


_BRANCHES = ("branch_computations", "true_computation", "false_computation")


def multiplicities(comps: list[Computation], entry: str) -> tuple[dict[str, int], set[str]]:
    """How many times each computation runs per call of the entry (while bodies x trip count), and the
    computations that run in a conditional's branch. The HLO does not say which branch a call takes, so
    each branch counts as running on every call: what runs in one is an upper bound (the 1F1B
    schedule's switch runs idle, forward or backward by tick)."""
    mult: dict[str, int] = defaultdict(int)
    in_branch: set[str] = set()
    mult[entry] = 1
    for comp in reversed(comps):  # callers are printed after their callees
        m = mult.get(comp.name, 0)
        if not m:
            continue
        for ins in comp.instrs.values():
            if ins.opcode.endswith("-done"):
                continue
            if ins.opcode == "while":
                trip = _TRIP.search(ins.attrs)
                for body in _called(ins.attrs, "body"):
                    mult[body] += m * (int(trip.group(1)) if trip else 1)
                    if comp.name in in_branch:
                        in_branch.add(body)
                continue
            for key in ("calls", *_BRANCHES):
                for callee in _called(ins.attrs, key):
                    mult[callee] += m
                    if key in _BRANCHES or comp.name in in_branch:
                        in_branch.add(callee)
    return dict(mult), in_branch


# --- replica groups -------------------------------------------------------------------------------------

def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def replica_groups(attrs: str, n_devices: int) -> list[list[int]] | None:
    """Device groups (indices into the flattened mesh) of a collective, or None if unreadable."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]*)\](?:T\(([0-9,]*)\))?\))? "
                  r"\{([^}]*)\}", attrs)
    if m:
        names = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        dims = [int(s) for _, s in names]
        ids = (_iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None) if m.group(2)
               else np.arange(math.prod(dims)))
        ids = ids.reshape(dims)
        reduce_axes = [i for i, (n, _) in enumerate(names) if f"'{n}'" in m.group(4)]
        keep = [i for i in range(len(dims)) if i not in reduce_axes]
        size = math.prod(dims[i] for i in reduce_axes)
        return ids.transpose(keep + reduce_axes).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?", attrs)
    if m:
        ids = _iota(_ints(m.group(3)), _ints(m.group(4)) if m.group(4) else None)
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m:
        groups = [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
        return groups or [list(range(n_devices))]
    return permute_pairs(attrs)


def permute_pairs(attrs: str) -> list[list[int]] | None:
    """A collective-permute's (source, target) pairs, or None where none are printed."""
    m = re.search(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    return [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))] if m else None


def group_axes(groups: list[list[int]], axis_names: tuple[str, ...], axis_sizes: tuple[int, ...]) -> tuple[str, ...]:
    """Mesh axes along which the devices of a group differ (the union over all groups)."""
    varying: set[int] = set()
    for g in groups:
        if len(g) < 2:
            continue
        coords = np.array(np.unravel_index(np.array(g), axis_sizes)).T
        varying |= {i for i in range(len(axis_sizes)) if len(set(coords[:, i])) > 1}
    return tuple(axis_names[i] for i in sorted(varying))


# --- the CPU reduce-scatter pattern ---------------------------------------------------------------------

# Ops that commute with taking a slice of their result: a value read only through them and then a
# 1/n slice is only needed on that slice.
_PASS_THROUGH = ("bitcast", "copy", "reshape", "transpose", "slice", "convert", "add", "subtract", "multiply",
                 "divide", "negate", "maximum", "minimum")


def _readers(comp: Computation, name: str, tuple_index: int | None, seen: set | None = None):
    """Final readers (instruction, operand position) of `name` (element `tuple_index` of it, if a tuple),
    looking through _PASS_THROUGH ops; every pass-through op visited is added to `seen`."""
    out = []
    for ins in comp.instrs.values():
        for pos, op in enumerate(ins.operands):
            if op != name:
                continue
            if tuple_index is not None:
                if ins.opcode != "get-tuple-element":
                    out.append((ins, pos))  # the whole tuple escapes
                    continue
                idx = re.search(r"index=(\d+)", ins.attrs)
                if idx and int(idx.group(1)) == tuple_index:
                    out.extend(_follow(comp, ins, seen))
            elif ins.opcode in _PASS_THROUGH:
                if seen is not None:
                    seen.add((comp.name, ins.name))
                out.extend(_follow(comp, ins, seen))
            else:
                out.append((ins, pos))
    return out


def _follow(comp: Computation, ins: Instr, seen: set | None = None) -> list[tuple[Instr, int]]:
    return _readers(comp, ins.name, None, seen)


def _slice_reads(reader: Instr, pos: int, comps: dict[str, Computation], comp: Computation,
                 seen: set | None = None) -> dict[tuple, int] | None:
    """The parts of operand `pos` this reader takes through dynamic slices, {part: elements}, or None
    if it reads the operand otherwise.

    A part is named by the static slices on the way to the dynamic slice: readers of one reduced
    gradient that take the same part (the optimizer update split over several fusions, some through
    a reshape) name it alike and count once, at the largest size read; the layers of a stacked
    gradient unstacked by static slices name theirs apart, so their parts add up.
    """
    if reader.opcode == "dynamic-slice":
        return {_part(comp, reader): _elems(reader.shape)} if pos == 0 else None
    if reader.opcode != "fusion":
        return None
    callees = _called(reader.attrs, "calls")
    if not callees or callees[0] not in comps:
        return None
    fused = comps[callees[0]]
    param = fused.params.get(pos)
    if param is None:
        return None
    readers = _follow(fused, fused.instrs[param], seen)
    if not readers or not all(r.opcode == "dynamic-slice" and p == 0 for r, p in readers):
        return None
    return _merge_parts({_part(fused, r): _elems(r.shape)} for r, _ in readers)


def _merge_parts(reads) -> dict[tuple, int]:
    """Parts read by several readers, each once, at the largest size any of them reads."""
    parts: dict[tuple, int] = {}
    for read in reads:
        for name, elems in read.items():
            parts[name] = max(parts.get(name, 0), elems)
    return parts


def _part(comp: Computation, dynamic_slice: Instr) -> tuple:
    """The static slices between a value and this dynamic slice of it."""
    statics = []
    ins = comp.instrs.get(dynamic_slice.operands[0])
    while ins is not None and ins.opcode in _PASS_THROUGH and ins.operands:
        if ins.opcode == "slice":
            statics.append(re.search(r"slice=\{[^}]*\}", ins.attrs).group(0))
        ins = comp.instrs.get(ins.operands[0])
    return tuple(statics)


def _elems(shape_text: str) -> int:
    arrays = _ARRAY.findall(shape_text)
    return sum(math.prod(int(d) for d in dims.split(",") if d) if dims else 1 for _, dims in arrays)


def _tuple_elements(shape_text: str) -> list[str]:
    """The top-level elements of a printed tuple shape: '((a, b), c)' gives ['(a, b)', 'c']."""
    inner, out, i = shape_text[1:-1], [], 0
    while i < len(inner):
        if inner[i] in " ,":
            i += 1
            continue
        end = _balanced(inner, i) if inner[i] == "(" else i
        while end < len(inner) and inner[end] != ",":
            end = _balanced(inner, end) if inner[end] in "([{" else end + 1
        out.append(inner[i:end])
        i = end + 1
    return out


def _element_shapes(shape_text: str) -> list[str]:
    if not shape_text.startswith("("):
        return [shape_text]
    return [f"{d}[{s}]" for d, s in _ARRAY.findall(shape_text)]


# --- putting it together --------------------------------------------------------------------------------

def _base_kind(opcode: str) -> str | None:
    op = opcode.removesuffix("-start")
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
            groups = pairs or _groups(ins, n_devices)
            axes = group_axes(groups, axis_names, axis_sizes)
            n = (2 if axes else 1) if kind == "collective-permute" else max(len(g) for g in groups)
            sizes = array_bytes(ins.shape)
            if ins.opcode.endswith("-start") and kind in ("all-gather", "collective-permute") and len(sizes) > 1:
                # all-gather: (inputs, outputs); permute: (inputs, outputs, context scalars); both nested when
                # XLA combined several, as ((in1, in2), (out1, out2), ...): the outputs are counted
                sizes = array_bytes(_tuple_elements(ins.shape)[1])
            if kind == "reduce-scatter":
                sizes = [s * n for s in sizes]  # ring traffic scales with the input, n x the output
            if kind == "all-reduce" and n > 1:
                split = _split_reduce_scatter(comp, ins, n, by_name, summed, axes, continued, axis_names, axis_sizes)
                for (logical, compiled_as, m, over), part in split.items():
                    total = sum(part)
                    k = _devices(over, axis_names, axis_sizes)
                    out.append(Collective(ins.name, logical, compiled_as, axes, n, count, total,
                                          wire_bytes("all-reduce", total, n), _logical_bytes(logical, total, k, m),
                                          comp.name in in_branch, None if over == axes else over))
                continue
            total = sum(sizes)
            w = wire_bytes(kind, total, n)
            if pairs:  # one sender a pair
                w *= min(len(pairs), n_devices) / n_devices
            out.append(Collective(ins.name, kind, ins.opcode, axes, n, count, total, w, w, comp.name in in_branch))
    return out


def _groups(ins: Instr, n_devices: int) -> list[list[int]]:
    """The collective's replica groups (none given: one group of every device)."""
    groups = replica_groups(ins.attrs, n_devices)
    return [list(range(n_devices))] if groups is None else groups


def _devices(axes: tuple[str, ...], axis_names: tuple[str, ...], axis_sizes: tuple[int, ...]) -> int:
    """Devices in a group spanning these mesh axes."""
    return math.prod(axis_sizes[axis_names.index(a)] for a in axes)


def _logical_bytes(logical: str, size: int, n: int, kept: int | None) -> float:
    """Bytes of the logical collective: an all-reduce over n devices that each keep 1/m of it is a
    reduce-scatter over m and an all-reduce of the 1/m part over the other n/m (FSDP's shard of a
    gradient that data parallel also reduces)."""
    if kept is None:  # summed into an earlier element before use: counted there
        return 0.0
    if logical == "all-reduce":
        return wire_bytes("all-reduce", size, n)
    return wire_bytes("reduce-scatter", size, kept) + wire_bytes("all-reduce", size / kept, n // kept)


def _split_reduce_scatter(comp: Computation, ins: Instr, n: int, comps: dict[str, Computation],
                          summed: list[tuple] | None = None, axes: tuple = (), continued: dict | None = None,
                          axis_names: tuple = (), axis_sizes: tuple = ()) -> dict[tuple, list[int]]:
    """The all-reduce's elements by how they are used, {(logical kind, compiled as, m, logical axes):
    [bytes]}, for elements used whole, elements only read through dynamic slices that keep 1/m of them
    (m dividing n: a CPU reduce-scatter, over all n or over some of the axes), elements summed with an
    earlier one before use (m None), and elements reduced again over other axes by the all-reduce that
    alone reads them (m None: counted there, as one all-reduce over both axes' devices; XLA:GPU's
    AllReduceFolder folds the two, XLA:CPU runs both: context parallel's gradients, over context, then
    over data).

    Elements of the same shape over the same axes that meet in one `add` (a parameter used twice, e.g.
    tied embeddings, has two partial gradients) count once, in one all-reduce or in two of the same
    computation (`summed` holds the earlier ones), also when one was reduced over other axes before
    (folded, above): XLA:GPU's AllReduceReassociate turns add(ar(a), ar(b)) into ar(add(a, b)); XLA:CPU
    reduces both.
    """
    groups: dict[tuple, list[int]] = defaultdict(list)
    elements = _element_shapes(ins.shape)
    is_tuple = ins.shape.startswith("(")
    summed = [] if summed is None else summed  # (shape, axes, adds) of each element so far
    continued = {} if continued is None else continued
    for i, shape in enumerate(elements):
        size, elems = sum(array_bytes(shape)), _elems(shape)
        shape = re.sub(r"\{[^}]*\}", "", shape)  # a tuple's elements are printed without their layout
        over = axes  # the logical all-reduce's axes: with those of the all-reduces this one continues
        if earlier := continued.get((ins.name, i)):
            over = tuple(a for a in axis_names if a in set(axes) | set(earlier))
        seen: set = set()
        readers = _readers(comp, ins.name, i if is_tuple else None, seen)
        if len(readers) == 1 and _base_kind(readers[0][0].opcode) == "all-reduce" and axis_names:
            nxt, pos = readers[0]
            if not set(over) & set(group_axes(_groups(nxt, math.prod(axis_sizes)), axis_names, axis_sizes)):
                continued[nxt.name, pos] = over
                groups["all-reduce", "all-reduce, reduced again over other axes", None, over].append(size)
                continue
        reads = [_slice_reads(r, p, comps, comp, seen) for r, p in readers]
        adds = {x for x in seen if comps[x[0]].instrs[x[1]].opcode == "add"}
        if elems > 1 and any(adds & earlier and (s, a) == (shape, axes) for s, a, earlier in summed):
            summed.append((shape, axes, set()))
            groups["all-reduce", "all-reduce (reassociable)", None, over].append(size)
            continue  # summed with an earlier element before use: one logical all-reduce
        summed.append((shape, axes, adds))
        parts = {} if not readers or None in reads else _merge_parts(reads)
        kept = sum(parts.values())
        k = n if over == axes else _devices(over, axis_names, axis_sizes)
        m = k if parts and kept * k <= elems else (elems // kept if parts and elems % kept == 0 else 0)
        if m > 1 and k % m == 0:
            label = "all-reduce+dynamic-slice" if m == k else f"all-reduce+dynamic-slice 1/{m}"
            groups["reduce-scatter", label, m, over].append(size)
        else:
            groups["all-reduce", ins.opcode if over == axes else "all-reduce, after one over other axes", 1,
                   over].append(size)
    return dict(groups)


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
        row["upper_bound"] |= c.in_branch
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
