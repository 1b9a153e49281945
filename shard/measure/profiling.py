"""`--profile-steps A:B`: a profiler trace of steps A..B (TensorBoard's profile plugin / xprof read it)
and a summary of where device time went: compute, each kind of collective, idle, and the exposed
(not overlapped with compute) share of communication."""

import gzip
import json
import re
from pathlib import Path

from shard.errors import ShardError
from shard.measure.hlo_text import called, parse_module
from shard.training.observer import Observer

# HLO op names (XLA:CPU and the GPU op line) and NCCL kernel names (GPU streams) -> collective kind.
_KINDS = (("all-reduce", r"^all-reduce|allreduce"), ("all-gather", r"^all-gather|allgather"),
          ("reduce-scatter", r"^reduce-scatter|reducescatter"), ("all-to-all", r"^all-to-all|alltoall"),
          ("collective-permute", r"^collective-permute|sendrecv"))
# Runtime bookkeeping that shares threads with XLA's ops, and control-flow ops that merely contain
# others (a `while` spans its body, collectives included): neither counts as compute.
_NOT_COMPUTE = re.compile(r"::|^end:|^Wait|^Rendezvous|^Handle |^Allocate|^ThreadpoolListener|^\$|PjitFunction|"
                          r"^ParseArguments|^Execute|^TfrtCpu|^PjRt|^ThunkExecutor|^while|^conditional|^call")


def collective_kind(name: str) -> str | None:
    low = name.lower()
    return next((kind for kind, rx in _KINDS if re.search(rx, low)), None)


def parse_window(text: str, steps: int) -> tuple[int, int]:
    """`3:5` -> (3, 5): steps 3 to 5, inclusive, within a run of `steps` steps."""
    m = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)) <= steps:
        raise ShardError(f"--profile-steps expects A:B with 1 <= A <= B <= {steps} (the run's steps), got {text!r}")
    return int(m.group(1)), int(m.group(2))


class Profiler(Observer):
    """Observer that traces steps [first, last] into `out_dir` and writes profile_summary.json."""

    def __init__(self, first: int, last: int, out_dir: Path):
        self.first, self.last, self.out_dir = first, last, out_dir
        self.summary: dict | None = None
        self._tracing = False
        self._step = 0  # the newest step seen
        self._hlo = None

    def on_start(self, run) -> None:
        self._step = run.start_step
        self._hlo = getattr(run, "step_hlo", None)  # the compiled step's text, for the compute split
        if run.start_step == self.first - 1:  # the window opens with this run's first step
            self._start()

    def on_step(self, step: int, outputs=None) -> None:
        import jax

        self._step = step
        if step == self.first - 1:
            jax.block_until_ready(outputs)
            self._start()
        if step == self.last and self._tracing:
            jax.block_until_ready(outputs)
            self._stop(summarize_steps=True)

    def on_end(self, records: list[dict]) -> None:
        """A run that stopped inside the window (a signal, --steps) gets the steps it traced."""
        self._stop(summarize_steps=self._step >= self.first)

    def on_abort(self) -> None:
        self._stop(summarize_steps=False)

    def _start(self) -> None:
        import jax

        jax.profiler.start_trace(str(self.out_dir), create_perfetto_trace=True)
        self._tracing = True

    def _stop(self, summarize_steps: bool) -> None:
        import jax

        if not self._tracing:
            return
        self._tracing = False
        jax.profiler.stop_trace()
        if summarize_steps:
            phases = op_phases(self._hlo()) if self._hlo else None
            self.summary = summarize(find_trace(self.out_dir), steps=min(self._step, self.last) - self.first + 1,
                                     phases=phases)
            (self.out_dir / "profile_summary.json").write_text(json.dumps(self.summary, indent=1))


def find_trace(out_dir: Path) -> Path:
    traces = sorted(Path(out_dir).rglob("perfetto_trace.json.gz"))
    if not traces:
        raise ShardError(f"no profiler trace under {out_dir}")
    return traces[-1]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _minus(a, b) -> float:
    """Length of the union `a` not covered by the union `b`."""
    covered, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            covered += max(0.0, min(e, b[k][1]) - max(s, b[k][0]))
            k += 1
    return _length(a) - covered


def device_timelines(events: list[dict]) -> dict[str, list[dict]]:
    """Op events per timeline: each /device:* process (a GPU, all its streams), or on CPU the host's
    XLA thread pool as one timeline (simulated devices share those threads, so no per-device line exists)."""
    pname = {e.get("pid"): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    tname = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    lines: dict[str, list[dict]] = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        proc, thread = pname.get(e.get("pid"), ""), tname.get((e.get("pid"), e.get("tid")), "")
        if proc.startswith("/device:"):
            lines.setdefault(proc, []).append(e)
        elif thread.startswith(("tf_XLAEigen", "tf_XLAPjRtCpuClient")):
            lines.setdefault(f"{proc or 'host'} (XLA:CPU threads)", []).append(e)
    return lines


# What a compiled op does, by the op_name JAX gives its HLO: the gradient's transpose, remat's rerun of the
# forward inside it, the forward (jvp), and what runs outside the gradient (the optimizer, the norm)
PHASES = (("remat recompute", "rematted_computation"), ("backward", "transpose("), ("forward", "jvp("))
OUTSIDE = "optimizer and outside the gradient"


def op_phases(hlo_text: str) -> dict[str, str]:
    """Each instruction of a compiled HLO module -> its phase (PHASES, else OUTSIDE), by its op_name; a
    fusion without one takes the phase of the ops it fuses (the first of PHASES any of them is in)."""
    names, fused, calls = {}, {}, {}
    for comp in parse_module(hlo_text)[0]:
        ops = fused.setdefault(comp.name, [])
        for ins in map(comp.instrs.get, comp.order):
            if op := re.search(r'op_name="([^"]*)"', ins.attrs):
                names[ins.name] = op.group(1)
                ops.append(op.group(1))
            if callee := called(ins.attrs, "calls"):
                calls[ins.name] = callee[0]
    for name, comp in calls.items():
        if name not in names and fused.get(comp):
            names[name] = next((o for _, mark in PHASES for o in fused[comp] if mark in o), fused[comp][-1])
    return {name: next((phase for phase, mark in PHASES if mark in op), OUTSIDE) for name, op in names.items()}


def compute_split(lines: dict[str, list[dict]], phases: dict[str, str]) -> dict[str, float]:
    """Shares of the compute ops' time (summed over threads and streams) per phase (op_phases); ops the
    module does not name (runtime copies) are `unattributed`."""
    time: dict[str, float] = {}
    for evs in lines.values():
        for e in evs:
            if not collective_kind(e["name"]) and not _NOT_COMPUTE.search(e["name"]):
                phase = phases.get(e["name"], "unattributed")
                time[phase] = time.get(phase, 0.0) + e["dur"]
    total = sum(time.values()) or 1.0
    return {k: v / total for k, v in sorted(time.items(), key=lambda kv: -kv[1])}


def summarize(trace: Path, steps: int = 1, phases: dict[str, str] | None = None) -> dict:
    """Fractions of the traced window per device timeline, averaged: compute, each collective kind,
    idle, and exposed communication (collective time with no compute running beside it); with the
    compiled step's `phases` (op_phases), the compute's split into forward, remat, backward and the rest."""
    data = json.loads(gzip.decompress(trace.read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    lines = device_timelines(events)
    if not lines:
        raise ShardError(f"the trace {trace} holds no device ops")
    starts = [e["ts"] for evs in lines.values() for e in evs if not _NOT_COMPUTE.search(e["name"])]
    ends = [e["ts"] + e["dur"] for evs in lines.values() for e in evs if not _NOT_COMPUTE.search(e["name"])]
    window = max(ends) - min(starts)
    kinds: dict[str, float] = {}
    compute = idle = exposed = 0.0
    for evs in lines.values():
        comm = [(collective_kind(e["name"]), e) for e in evs]
        comm = [(k, e) for k, e in comm if k]
        comp_iv = _union([(e["ts"], e["ts"] + e["dur"]) for e in evs
                          if not collective_kind(e["name"]) and not _NOT_COMPUTE.search(e["name"])])
        comm_iv = _union([(e["ts"], e["ts"] + e["dur"]) for _, e in comm])
        for kind in {k for k, _ in comm}:  # union per kind: concurrent threads/streams count once
            iv = _union([(e["ts"], e["ts"] + e["dur"]) for k, e in comm if k == kind])
            kinds[kind] = kinds.get(kind, 0.0) + _length(iv)
        compute += _length(comp_iv)
        exposed += _minus(comm_iv, comp_iv)
        idle += window - _length(_union(comp_iv + comm_iv))
    n = len(lines) * window
    return {
        "window_ms": window / 1e3,
        "steps": steps,
        "timelines": len(lines),
        "compute_frac": compute / n,
        "collectives_frac": {k: v / n for k, v in sorted(kinds.items())},
        "exposed_comm_frac": exposed / n,
        "idle_frac": idle / n,
    } | ({"compute_split": compute_split(lines, phases)} if phases else {})


def format_summary(s: dict) -> str:
    parts = [f"compute {s['compute_frac']:.0%}"]
    parts += [f"{k} {v:.0%}" for k, v in s["collectives_frac"].items()]
    parts += [f"exposed communication {s['exposed_comm_frac']:.0%}", f"idle {s['idle_frac']:.0%}"]
    split = "; compute: " + ", ".join(f"{k} {v:.0%}" for k, v in s["compute_split"].items()) \
        if s.get("compute_split") else ""
    return (f"profile of {s['steps']} step(s), {s['window_ms']:.1f} ms on {s['timelines']} device timeline(s): "
            + ", ".join(parts) + split)
