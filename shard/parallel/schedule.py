"""Pipeline schedules as data: one table of (tick, stage, microbatch, chunk, phase) rows per schedule,
built by a pure function (numpy, no JAX). The executor (shard/parallel/pipeline.py) runs it, the cost
model and `shard plan` read its bubble and held inputs, `shard inspect` draws it, and
benchmarks/layouts.py sets its bubble beside the formula's.

Every op takes one tick; a message sent at tick t is usable at t + 1. Virtual stage v = chunk * S + stage
holds layers [v L / (V S), (v + 1) L / (V S)) (V = 1 but for the interleaved schedule), so a chunk's
forward on the last stage feeds the next chunk on stage 0. Phases: F (forward), B (backward: the input's
gradient, and in the schedules without W the weights' too), W (the weights' gradient, zero-bubble only).
"""

import functools
from dataclasses import dataclass

import numpy as np

from shard.config.train import PIPELINE_SCHEDULES
from shard.errors import ShardError

IDLE, FWD, BWD, WGT = 0, 1, 2, 3
PHASE_CHARS = ".FBW"
SCHEDULES = PIPELINE_SCHEDULES  # the config's list: gpipe, 1f1b, interleaved, zero_bubble
COLUMNS = ("tick", "stage", "microbatch", "chunk", "phase")


def bubble_formula(kind: str, S: int, M: int, V: int = 1) -> float:
    """Idle share of each stage's step with equal-cost ops: GPipe and 1F1B (S-1)/(M+S-1); interleaved
    (S-1)/(VM+S-1) (a fill and a drain of one chunk, 1/V of a stage); zero-bubble (S-1)/(3M+S-1) (W
    fills the drain: one op of the three idles per stage, where 1F1B idles two of two)."""
    # the work of one stage in ticks, over the ticks a fill and a drain add: 2(S-1) of them, S-1 for zero-bubble
    work, fill = {"gpipe": (2 * M, 2), "1f1b": (2 * M, 2), "interleaved": (2 * V * M, 2),
                  "zero_bubble": (3 * M, 1)}[kind]
    return fill * (S - 1) / (work + fill * (S - 1))


@dataclass(frozen=True)
class Schedule:
    """`table`: (n, 5) int32 rows of COLUMNS, one per op, in tick order."""

    kind: str
    stages: int
    microbatches: int
    virtual: int
    table: np.ndarray

    @property
    def ticks(self) -> int:
        return int(self.table[:, 0].max()) + 1

    def grid(self, column: str, empty: int = 0) -> np.ndarray:
        """(ticks, stages): the column's value of the op stage s runs at tick t (`empty` where idle)."""
        out = np.full((self.ticks, self.stages), empty, np.int32)
        out[self.table[:, 0], self.table[:, 1]] = self.table[:, COLUMNS.index(column)]
        return out

    @property
    def op(self) -> np.ndarray:
        return self.grid("phase", IDLE)

    @property
    def mb(self) -> np.ndarray:
        return self.grid("microbatch")

    def idle_fraction(self) -> float:
        """Bubble by schedule: the share of (tick, stage) slots with no op."""
        return 1.0 - len(self.table) / (self.ticks * self.stages)

    def held(self) -> list[int]:
        """Peak microbatch inputs each stage keeps at once (from its F to its last use, B or W): the
        activation memory, in one microbatch's stage input as the unit."""
        return self.peaks(FWD, WGT if (self.table[:, 4] == WGT).any() else BWD)

    def peaks(self, opens: int, closes: int) -> list[int]:
        """Per stage, the most of its microbatches at once between an `opens` phase and their `closes` one."""
        out = []
        for s in range(self.stages):
            phases = self.table[self.table[:, 1] == s, 4]
            out.append(int(np.cumsum((phases == opens).astype(int) - (phases == closes)).max(initial=0)))
        return out

    def sends(self) -> list[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]]:
        """Per tick, the (from, to) stage pairs passing an activation forward (an F whose virtual stage is
        not the last) and a gradient backward (a B whose virtual stage is not the first): each
        microbatch crosses each boundary once each way, the minimum."""
        S, last = self.stages, self.virtual * self.stages - 1
        out = [([], []) for _ in range(self.ticks)]
        for t, s, _, c, phase in self.table:
            v = c * S + s
            if phase == FWD and v < last:
                out[t][0].append((int(s), int((s + 1) % S)))
            elif phase == BWD and v > 0:
                out[t][1].append((int(s), int((s - 1) % S)))
        return [(tuple(sorted(f)), tuple(sorted(b))) for f, b in out]

    def chart(self) -> str:
        """Stages x ticks: F/B/W for an op (the phase), . where idle."""
        chars = np.array(list(PHASE_CHARS))[self.op]
        return "\n".join(f"stage {s} " + "".join(chars[:, s]) for s in range(self.stages))


def check(kind: str, S: int, M: int, V: int, n_layers: int) -> None:
    """One-line errors for combinations a schedule cannot run."""
    if kind not in SCHEDULES:
        raise ShardError(f"pipeline.schedule must be one of {', '.join(SCHEDULES)}, got {kind!r}")
    if V < 1:
        raise ShardError(f"pipeline.virtual_stages must be at least 1, got {V}")
    if V > 1 and kind != "interleaved":
        raise ShardError(f"pipeline.virtual_stages={V} needs pipeline.schedule=interleaved (got {kind})")
    if n_layers % (V * S):
        if V == 1:
            raise ShardError(f"pipeline: {n_layers} layers do not split into {S} stages; use a stage count that "
                             "divides model.n_layers")
        raise ShardError(f"pipeline: {n_layers} layers do not split into {S} stages x {V} virtual stages; use "
                         f"a stage count times pipeline.virtual_stages that divides model.n_layers")
    if kind == "interleaved" and M % S:
        raise ShardError(f"pipeline: the interleaved schedule runs microbatches in groups of the {S} stages; "
                         f"pipeline.microbatches={M} is not a multiple of {S}")


def slots(sch: Schedule) -> int:
    """Fewest input-buffer slots (unit u = chunk * M + microbatch in slot u % K) such that no live input
    is overwritten: stage s holds a unit's input from its arrival (the tick after the virtual stage
    before ran its F; virtual stage 0: its own F) to its B, and the gradient from the virtual stage after
    (arriving later) as long. (Zero-bubble's W reads what its B kept, not the input: `w_slots`.)"""
    S, M, V = sch.stages, sch.microbatches, sch.virtual
    t_f = np.zeros((V * S, M), int)  # by virtual stage
    t_b = np.zeros((V * S, M), int)  # the last use: B
    for t, s, m, c, phase in sch.table:
        if phase == FWD:
            t_f[c * S + s, m] = t
        elif phase == BWD:
            t_b[c * S + s, m] = t
    # arrival of the input on each virtual stage (its gradient arrives later, after the next one's F)
    start = np.concatenate([t_f[:1], t_f[:-1] + 1])
    live = [[(start[c * S + s, m], t_b[c * S + s, m]) for c in range(V) for m in range(M)] for s in range(S)]
    U = V * M
    for k in range(1, U + 1):
        if all(not (a[0] <= b[1] and b[0] <= a[1]) for s in range(S) for u1 in range(U)
               for u2 in range(u1 + k, U, k) for a, b in [(live[s][u1], live[s][u2])]):
            return k
    return U


def w_slots(sch: Schedule) -> int:
    """Most W's waiting on one stage at once (its B run, its W not yet): the slots zero-bubble's B needs
    for what it keeps for W. W's run oldest first, so microbatch m can take slot m % w_slots."""
    return max(sch.peaks(BWD, WGT))


@functools.lru_cache(maxsize=64)
def build(kind: str, S: int, M: int, V: int = 1) -> Schedule:
    """The schedule's table: each stage's order of ops placed as early as dependencies allow."""
    if kind == "zero_bubble":
        table = _place(_one_f_one_b_orders(S, M), S, 1, w_cap=lambda s: s + 1)
    else:
        orders = (_gpipe_orders(S, M) if kind == "gpipe" else _interleaved_orders(S, M, V) if kind == "interleaved"
                  else _one_f_one_b_orders(S, M))
        table = _place(orders, S, V)
    return Schedule(kind, S, M, V, table)


def _gpipe_orders(S: int, M: int) -> list[list[tuple[int, int, int]]]:
    return [[(FWD, m, 0) for m in range(M)] + [(BWD, m, 0) for m in range(M)] for _ in range(S)]


def _one_f_one_b_orders(S: int, M: int) -> list[list[tuple[int, int, int]]]:
    """Warm-up S-1-s forwards, then one forward and one backward in turn, then the remaining backwards."""
    orders = []
    for s in range(S):
        warm = min(S - 1 - s, M)
        order = [(FWD, m, 0) for m in range(warm)]
        for i in range(M - warm):
            order += [(FWD, warm + i, 0), (BWD, i, 0)]
        orders.append(order + [(BWD, m, 0) for m in range(M - warm, M)])
    return orders


def _interleaved_orders(S: int, M: int, V: int) -> list[list[tuple[int, int, int]]]:
    """Megatron's interleaved 1F1B: microbatches in groups of S, each group through chunk 0, 1, ... V-1
    forwards and V-1 ... 0 backwards; a longer warm-up ((S-1-s) * 2 + (V-1) * S forwards)."""
    groups = range(M // S)
    fwd = [(m, c) for g in groups for c in range(V) for m in range(g * S, g * S + S)]
    bwd = [(m, c) for g in groups for c in reversed(range(V)) for m in range(g * S, g * S + S)]
    orders = []
    for s in range(S):
        warm = min((S - 1 - s) * 2 + (V - 1) * S, V * M)
        order = [(FWD, *fwd[i]) for i in range(warm)]
        for i in range(V * M - warm):
            order += [(FWD, *fwd[warm + i]), (BWD, *bwd[i])]
        orders.append(order + [(BWD, *bwd[i]) for i in range(V * M - warm, V * M)])
    return orders


def _place(orders, S: int, V: int, w_cap=None) -> np.ndarray:
    """Run each stage's order as early as dependencies allow, one op per stage per tick. With `w_cap`
    (zero-bubble), B leaves the weights' gradient W pending: a stage runs its oldest pending W where its
    next F or B cannot run yet, and before anything else once `w_cap(s)` of them wait (the memory bound)."""
    done: dict[tuple[int, int, int], int] = {}  # (phase, microbatch, virtual stage) -> tick
    nxt, pending, rows, t = [0] * S, [[] for _ in range(S)], [], 0
    limit = 8 * (sum(map(len, orders)) + S)
    while any(nxt[s] < len(orders[s]) or pending[s] for s in range(S)):
        run = []
        for s in range(S):
            w_ready = bool(pending[s]) and done[(BWD, pending[s][0][0], pending[s][0][1] * S + s)] < t
            if w_ready and len(pending[s]) >= w_cap(s):
                run.append((s, WGT, *pending[s].pop(0)))
                continue
            if nxt[s] < len(orders[s]) and _ready(orders[s][nxt[s]], s, S, V, done, t):
                run.append((s, *orders[s][nxt[s]]))
            elif w_ready:
                run.append((s, WGT, *pending[s].pop(0)))
        for s, phase, m, c in run:
            done[(phase, m, c * S + s)] = t
            rows.append((t, s, m, c, phase))
            nxt[s] += phase != WGT
            if phase == BWD and w_cap is not None:
                pending[s].append((m, c))
        t += 1
        if t > limit:
            raise AssertionError("pipeline schedule did not finish")
    return np.array(rows, np.int32).reshape(-1, len(COLUMNS))


def _ready(op: tuple[int, int, int], s: int, S: int, V: int, done: dict, t: int) -> bool:
    """Whether op (phase, microbatch, chunk) on stage s has what it needs before tick t."""
    phase, m, c = op
    v = c * S + s
    if phase == FWD:
        need = None if v == 0 else (FWD, m, v - 1)
    else:
        need = (FWD, m, v) if v == V * S - 1 else (BWD, m, v + 1)
    return need is None or done.get(need, t) < t

