"""The CPU lowering of a reduce-scatter: an all-reduce whose result is read only through dynamic slices
of 1/n of it (or of 1/m: a reduce-scatter over m devices and an all-reduce over the rest), found by
following each element of the all-reduce to what reads it. Also the all-reduces XLA:GPU would fold or
reassociate into one, which XLA:CPU runs apart, and the ones it widens: XLA:CPU reduces a bf16 value in
f32 (a convert before, one after, often each in a fusion of its own), so the program moves half the bytes
the compiled all-reduce does.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from shard.measure.hlo_groups import devices_over, group_axes, groups_of
from shard.measure.hlo_text import DTYPE_BYTES, Computation, Instr, array_bytes, called, element_count, element_shapes

# Ops that commute with taking a slice of their result: a value read only through them and then a
# 1/n slice is only needed on that slice.
_PASS_THROUGH = ("bitcast", "copy", "reshape", "transpose", "slice", "convert", "add", "subtract", "multiply",
                 "divide", "negate", "maximum", "minimum")


def _fused(ins: Instr, comps: dict[str, Computation]) -> Computation | None:
    """The computation a fusion of only _PASS_THROUGH ops calls (XLA:CPU's `wrapped_convert`, a layer's
    slice of a stacked gradient and its convert, the add of two partial gradients), else None: it reads
    its operands as those ops do."""
    if ins.opcode != "fusion":
        return None
    callees = called(ins.attrs, "calls")
    fused = comps.get(callees[0]) if callees else None
    if fused is None or any(i.opcode not in (*_PASS_THROUGH, "parameter") for i in fused.instrs.values()):
        return None
    return fused


def _passes(ins: Instr, comps: dict[str, Computation]) -> bool:
    return ins.opcode in _PASS_THROUGH or _fused(ins, comps) is not None

_MOVES = ("bitcast", "copy", "reshape", "transpose", "slice", "convert")  # values moved or cast, not combined


def _readers(comp: Computation, name: str, tuple_index: int | None, seen: set | None = None,
             comps: dict[str, Computation] | None = None):
    """Final readers (instruction, operand position) of `name` (element `tuple_index` of it, if a tuple),
    looking through _PASS_THROUGH ops and fusions of them. The adds met before anything else combines the
    value (only moved or cast on the way: the add of two all-reduced values) are added to `seen`."""
    comps = comps or {}
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
                    out.extend(_follow(comp, ins, seen, comps))
            elif _passes(ins, comps):
                fused = _fused(ins, comps)
                if seen is not None:
                    seen |= _direct_adds(fused, fused.params[pos]) if fused else {(comp.name, ins.name)}
                # past arithmetic, an add sums more than the all-reduced values: not AllReduceReassociate's
                moves = fused is None and ins.opcode in _MOVES or fused and all(
                    i.opcode in (*_MOVES, "parameter") for i in fused.instrs.values())
                out.extend(_follow(comp, ins, seen if moves else None, comps))
            else:
                out.append((ins, pos))
    return out


def _direct_adds(comp: Computation, name: str) -> set[tuple[str, str]]:
    """The adds that take `name` as it is, through layout ops and converts only (an add of two all-reduced
    values, each converted back to bf16, in one fusion): the add AllReduceReassociate would rewrite."""
    out: set = set()
    for ins in comp.instrs.values():
        if name in ins.operands:
            if ins.opcode == "add":
                out.add((comp.name, ins.name))
            elif ins.opcode in _MOVES:
                out |= _direct_adds(comp, ins.name)
    return out


def _follow(comp: Computation, ins: Instr, seen: set | None = None,
            comps: dict[str, Computation] | None = None) -> list[tuple[Instr, int]]:
    return _readers(comp, ins.name, None, seen, comps)


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
        return {_part(comp, reader, comps): element_count(reader.shape)} if pos == 0 else None
    if reader.opcode != "fusion":
        return None
    callees = called(reader.attrs, "calls")
    if not callees or callees[0] not in comps:
        return None
    fused = comps[callees[0]]
    param = fused.params.get(pos)
    if param is None:
        return None
    readers = _follow(fused, fused.instrs[param], seen, comps)
    if not readers or not all(r.opcode == "dynamic-slice" and p == 0 for r, p in readers):
        return None
    outer = _statics(comp, comp.instrs.get(reader.operands[pos]), comps)  # slices before the fusion
    return _merge_parts({outer + _part(fused, r, comps): element_count(r.shape)} for r, _ in readers)


def _merge_parts(reads) -> dict[tuple, int]:
    """Parts read by several readers, each once, at the largest size any of them reads."""
    parts: dict[tuple, int] = {}
    for read in reads:
        for name, elems in read.items():
            parts[name] = max(parts.get(name, 0), elems)
    return parts


def _part(comp: Computation, dynamic_slice: Instr, comps: dict[str, Computation] | None = None) -> tuple:
    """The static slices between a value and this dynamic slice of it."""
    return _statics(comp, comp.instrs.get(dynamic_slice.operands[0]), comps or {})


def _statics(comp: Computation, ins: Instr | None, comps: dict[str, Computation]) -> tuple:
    """The static slices on the way back from `ins` through pass-through ops and fusions of them."""
    statics: list = []
    while ins is not None and ins.operands and _passes(ins, comps):
        if ins.opcode == "slice":
            statics.append(re.search(r"slice=\{[^}]*\}", ins.attrs).group(0))
        elif (fused := _fused(ins, comps)) is not None:
            root = fused.instrs[fused.order[-1]]
            statics.extend(_statics(fused, root, comps))
        ins = comp.instrs.get(ins.operands[0])
    return tuple(statics)


def narrowed_to(comp: Computation, name: str, tuple_index: int | None,
                comps: dict[str, Computation]) -> str | None:
    """The type every reader of `name` (its element `tuple_index`) converts it to before anything else,
    looking through layout ops and into the fusions that read it (XLA:CPU's `wrapped_convert`, or the
    convert that opens a concatenate's fusion), else None."""
    found: set[str] = set()

    def visit(c: Computation, value: str, index: int | None) -> bool:
        readers = [r for r in c.instrs.values() if value in r.operands]
        for r in readers:
            if index is not None:
                idx = re.search(r"index=(\d+)", r.attrs)
                if r.opcode != "get-tuple-element":
                    return False
                if idx and int(idx.group(1)) == index and not visit(c, r.name, None):
                    return False
            elif r.opcode == "convert":
                found.add(re.match(r"[a-z0-9]+", r.shape).group(0))
            elif r.opcode in ("bitcast", "copy", "reshape", "transpose"):
                if not visit(c, r.name, None):
                    return False
            elif r.opcode == "fusion" and (fused := comps.get(next(iter(called(r.attrs, "calls")), ""))):
                if not all(visit(fused, fused.params[p], None) for p, op in enumerate(r.operands) if op == value):
                    return False
            else:
                return False
        return bool(readers)

    return found.pop() if visit(comp, name, tuple_index) and len(found) == 1 else None


def program_bytes(comp: Computation, name: str, tuple_index: int | None, shape: str,
                  comps: dict[str, Computation]) -> tuple[int, str]:
    """Bytes of a collective's result (element) in the type the program moves, and a note where the
    backend widened it (", bf16 widened to f32"; else "")."""
    size = sum(array_bytes(shape))
    narrow = narrowed_to(comp, name, tuple_index, comps)
    wide = re.match(r"[a-z0-9]+", shape).group(0)
    if not narrow or narrow not in DTYPE_BYTES or DTYPE_BYTES[narrow] >= DTYPE_BYTES.get(wide, 0):
        return size, ""
    return size * DTYPE_BYTES[narrow] // DTYPE_BYTES[wide], f", {narrow} widened to {wide}"


def split_reduce_scatter(comp: Computation, ins: Instr, n: int, comps: dict[str, Computation],
                         summed: list[tuple] | None = None, axes: tuple = (), continued: dict | None = None,
                         axis_names: tuple = (), axis_sizes: tuple = ()) -> dict[tuple, list[int]]:
    """The all-reduce's elements by how they are used, {(logical kind, compiled as, m, logical axes):
    [(bytes compiled, bytes of the program's dtype)]}, for elements used whole, elements only read through dynamic slices that keep 1/m of them
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

    An element every reader first converts to a narrower type (XLA:CPU's all-reduce of a bf16 value in
    f32) moves that type's bytes in the program: its label says so (", bf16 widened to f32").
    """
    groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
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
        moved, note = program_bytes(comp, ins.name, i if is_tuple else None, shape, comps)
        sizes = (size, moved)
        seen: set = set()
        readers = _readers(comp, ins.name, i if is_tuple else None, seen, comps)
        if len(readers) == 1 and readers[0][0].opcode.removesuffix("-start") == "all-reduce" and axis_names:
            nxt, pos = readers[0]
            if not set(over) & set(group_axes(groups_of(nxt, math.prod(axis_sizes)), axis_names, axis_sizes)):
                continued[nxt.name, pos] = over
                groups["all-reduce", "all-reduce, reduced again over other axes" + note, None, over].append(sizes)
                continue
        reads = [_slice_reads(r, p, comps, comp, seen) for r, p in readers]
        adds = {x for x in seen if comps[x[0]].instrs[x[1]].opcode == "add"}
        if elems > 1 and any(adds & earlier and (s, a) == (shape, axes) for s, a, earlier in summed):
            summed.append((shape, axes, set()))
            groups["all-reduce", "all-reduce (reassociable)" + note, None, over].append(sizes)
            continue  # summed with an earlier element before use: one logical all-reduce
        summed.append((shape, axes, adds))
        parts = {} if not readers or None in reads else _merge_parts(reads)
        kept = sum(parts.values())
        k = n if over == axes else devices_over(over, axis_names, axis_sizes)
        m = k if parts and kept * k <= elems else (elems // kept if parts and elems % kept == 0 else 0)
        if m > 1 and k % m == 0:
            label = "all-reduce+dynamic-slice" if m == k else f"all-reduce+dynamic-slice 1/{m}"
            groups["reduce-scatter", label + note, m, over].append(sizes)
        else:
            label = ins.opcode if over == axes else "all-reduce, after one over other axes"
            groups["all-reduce", label + note, 1, over].append(sizes)
    return dict(groups)
