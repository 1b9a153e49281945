"""HLO text read into its computations and instructions, and how many times each computation runs.

No maintained Python parser of HLO text ships with JAX, and the protobuf route needs XLA's proto
definitions, so this reads the handful of things shard needs with regular expressions. Computations
called from a `while` run `known_trip_count` times (layers are scanned, so a per-layer collective
appears once in the loop body).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}

# HLO's element type names as NumPy (ml_dtypes) names, for building arrays of a printed shape
NUMPY_NAMES = {
    "pred": "bool", "s4": "int4", "u4": "uint4", "s8": "int8", "u8": "uint8", "s16": "int16", "u16": "uint16",
    "s32": "int32", "u32": "uint32", "s64": "int64", "u64": "uint64", "f16": "float16", "bf16": "bfloat16",
    "f32": "float32", "f64": "float64", "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
    "f8e4m3": "float8_e4m3", "f8e5m2fnuz": "float8_e5m2fnuz", "f8e4m3fnuz": "float8_e4m3fnuz",
    "f8e4m3b11fnuz": "float8_e4m3b11fnuz",
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


def called(attrs: str, key: str) -> list[str]:
    """The computations an instruction calls under `key` (calls, body, branch_computations, ...)."""
    m = re.search(key + r"=\{([^}]*)\}", attrs)
    if m:
        return re.findall(r"%([^\s,}]+)", m.group(1))
    m = re.search(key + r"=%([^\s,]+)", attrs)
    return [m.group(1)] if m else []


_BRANCHES = ("branch_computations", "true_computation", "false_computation")


def multiplicities(comps: list[Computation], entry: str) -> tuple[dict[str, int], dict[str, tuple[str, int]]]:
    """How many times each computation runs per call of the entry (while bodies x trip count), and the
    computations that run in a conditional's branch, each with that (outermost) conditional's name and
    the branch's index. The HLO does not say which branch a call takes, so each branch counts as running
    on every call: what runs in one is an upper bound (the table schedules' switch runs idle, forward or
    backward by tick; `analysis.table_exact_bytes` weighs the branches by the schedule table)."""
    mult: dict[str, int] = defaultdict(int)
    in_branch: dict[str, tuple[str, int]] = {}
    mult[entry] = 1
    for comp in reversed(comps):  # callers are printed after their callees
        m = mult.get(comp.name, 0)
        if not m:
            continue
        outer = in_branch.get(comp.name)
        for ins in comp.instrs.values():
            if ins.opcode.endswith("-done"):
                continue
            if ins.opcode == "while":
                trip = _TRIP.search(ins.attrs)
                for body in called(ins.attrs, "body"):
                    mult[body] += m * (int(trip.group(1)) if trip else 1)
                    if outer:
                        in_branch.setdefault(body, outer)
                continue
            for key in ("calls", *_BRANCHES):
                for i, callee in enumerate(called(ins.attrs, key)):
                    mult[callee] += m
                    if outer or key in _BRANCHES:
                        in_branch.setdefault(callee, outer or (ins.name, i if key == "branch_computations"
                                                               else int(key == "false_computation")))
    return dict(mult), in_branch


def element_count(shape_text: str) -> int:
    """Elements of the arrays in a printed shape, summed."""
    arrays = _ARRAY.findall(shape_text)
    return sum(math.prod(int(d) for d in dims.split(",") if d) if dims else 1 for _, dims in arrays)


def tuple_elements(shape_text: str) -> list[str]:
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


def first_array(shape_text: str) -> tuple[str, tuple[int, ...]] | None:
    """The dtype and dims of the first array in a printed shape ("bf16[256,64]{1,0}" -> ("bf16", (256, 64)))."""
    m = _ARRAY.search(shape_text)
    return (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)) if m else None


def element_shapes(shape_text: str) -> list[str]:
    """A printed shape as one array (as printed), or each array of a tuple as dtype[dims], flattened."""
    if not shape_text.startswith("("):
        return [shape_text]
    return [f"{d}[{s}]" for d, s in _ARRAY.findall(shape_text)]
