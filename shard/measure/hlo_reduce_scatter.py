"""The CPU lowering of a reduce-scatter: an all-reduce whose result is read only through dynamic slices
of 1/n of it (or of 1/m: a reduce-scatter over m devices and an all-reduce over the rest), found by
following each element of the all-reduce to what reads it. Also the all-reduces XLA:GPU would fold or
reassociate into one, which XLA:CPU runs apart.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from shard.measure.hlo_groups import devices_over, group_axes, groups_of
from shard.measure.hlo_text import Computation, Instr, array_bytes, called, element_count, element_shapes

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
        return {_part(comp, reader): element_count(reader.shape)} if pos == 0 else None
    if reader.opcode != "fusion":
        return None
    callees = called(reader.attrs, "calls")
    if not callees or callees[0] not in comps:
        return None
    fused = comps[callees[0]]
    param = fused.params.get(pos)
    if param is None:
        return None
    readers = _follow(fused, fused.instrs[param], seen)
    if not readers or not all(r.opcode == "dynamic-slice" and p == 0 for r, p in readers):
        return None
    return _merge_parts({_part(fused, r): element_count(r.shape)} for r, _ in readers)


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


def split_reduce_scatter(comp: Computation, ins: Instr, n: int, comps: dict[str, Computation],
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
    elements = element_shapes(ins.shape)
    is_tuple = ins.shape.startswith("(")
    summed = [] if summed is None else summed  # (shape, axes, adds) of each element so far
    continued = {} if continued is None else continued
    for i, shape in enumerate(elements):
        size, elems = sum(array_bytes(shape)), element_count(shape)
        shape = re.sub(r"\{[^}]*\}", "", shape)  # a tuple's elements are printed without their layout
        over = axes  # the logical all-reduce's axes: with those of the all-reduces this one continues
        if earlier := continued.get((ins.name, i)):
            over = tuple(a for a in axis_names if a in set(axes) | set(earlier))
        seen: set = set()
        readers = _readers(comp, ins.name, i if is_tuple else None, seen)
        if len(readers) == 1 and readers[0][0].opcode.removesuffix("-start") == "all-reduce" and axis_names:
            nxt, pos = readers[0]
            if not set(over) & set(group_axes(groups_of(nxt, math.prod(axis_sizes)), axis_names, axis_sizes)):
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
        k = n if over == axes else devices_over(over, axis_names, axis_sizes)
        m = k if parts and kept * k <= elems else (elems // kept if parts and elems % kept == 0 else 0)
        if m > 1 and k % m == 0:
            label = "all-reduce+dynamic-slice" if m == k else f"all-reduce+dynamic-slice 1/{m}"
            groups["reduce-scatter", label, m, over].append(size)
        else:
            groups["all-reduce", ins.opcode if over == axes else "all-reduce, after one over other axes", 1,
                   over].append(size)
    return dict(groups)
