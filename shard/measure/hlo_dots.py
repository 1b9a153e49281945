"""The matmuls of a compiled program: each distinct `dot` of its HLO (operand shapes and dtypes, result
dtype, dimension numbers) with how many times it runs per call (while bodies x trip count, as
hlo_text.multiplicities counts them; a loop without a known trip count once) and its FLOPs.
`benchmarks/ceiling.py` times each alone to bound what the program's matmuls allow (docs/performance.md).

XLA:CPU's optimized HLO keeps its matmuls as `dot` instructions (inside YNNPACK fusions); a GPU's calls
cuBLAS through custom-calls, which this does not read. A dot in a conditional's branch (the table
schedules' switch) is counted as if its branch ran on every call, and marked `in_branch`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

from shard.measure import hlo_text

_DIMS = ("lhs_batch_dims", "lhs_contracting_dims", "rhs_batch_dims", "rhs_contracting_dims")


@dataclass(frozen=True)
class Dot:
    lhs: tuple[str, tuple[int, ...]]  # (dtype, dims) as XLA prints them: "bf16", (256, 256)
    rhs: tuple[str, tuple[int, ...]]
    out_dtype: str
    lhs_batch: tuple[int, ...]
    lhs_contracting: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    rhs_contracting: tuple[int, ...]
    in_branch: bool = False  # in a conditional's branch: its count is an upper bound

    @property
    def flops(self) -> int:
        """2 x the output's elements x the contracted size."""
        dims = self.lhs[1]
        free = [d for i, d in enumerate(dims) if i not in self.lhs_batch + self.lhs_contracting]
        rhs_free = [d for i, d in enumerate(self.rhs[1]) if i not in self.rhs_batch + self.rhs_contracting]
        batch = math.prod(dims[i] for i in self.lhs_batch)
        k = math.prod(dims[i] for i in self.lhs_contracting)
        return 2 * batch * math.prod(free) * math.prod(rhs_free) * k

    def label(self) -> str:
        def side(a, b, c):
            return f"{a[0]}[{','.join(map(str, a[1]))}] b{list(b)} k{list(c)}"
        return (f"{side(self.lhs, self.lhs_batch, self.lhs_contracting)} x "
                f"{side(self.rhs, self.rhs_batch, self.rhs_contracting)} -> {self.out_dtype}")


def _dims(attrs: str, key: str) -> tuple[int, ...]:
    m = re.search(key + r"=\{([0-9,]*)\}", attrs)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def dots(text: str) -> Counter:
    """Each distinct dot of the HLO module `text` -> how many times it runs per call of the entry. A dot
    whose operands' shapes the text does not give is an error, not a dot left out."""
    comps, entry = hlo_text.parse_module(text)
    mult, in_branch = hlo_text.multiplicities(comps, entry)
    out: Counter = Counter()
    for comp in comps:
        m = mult.get(comp.name, 0)
        if not m:
            continue
        for ins in comp.instrs.values():
            if ins.opcode != "dot":
                continue
            lhs, rhs = (hlo_text.first_array(comp.instrs[o].shape) if o in comp.instrs else None for o in ins.operands[:2])
            result = hlo_text.first_array(ins.shape)
            if len(ins.operands) != 2 or lhs is None or rhs is None or result is None:
                raise ValueError(f"dot {ins.name} in {comp.name}: its operands' shapes are not in the HLO text")
            out[Dot(lhs, rhs, result[0], *(_dims(ins.attrs, k) for k in _DIMS), comp.name in in_branch)] += m
    return out


def total_flops(counted: Counter) -> int:
    """The FLOPs of the counted dots, each times its count."""
    return sum(d.flops * n for d, n in counted.items())
