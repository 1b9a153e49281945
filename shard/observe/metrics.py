"""Where logged metrics go: metrics.jsonl (one JSON object per logged step, and the event records `shard launch`
appends between jobs) and TensorBoard events."""

import atexit
import contextlib
import json
import math
import time
from pathlib import Path

from shard.training.observer import Observer


# A GRPO record's few sampled completions: written to completions.jsonl (CompletionsWriter), not metrics.jsonl.
COMPLETIONS = "completions"


class JsonlWriter(Observer):
    """Appends each logged record as one line; flushed per line so a crash loses nothing logged."""

    def __init__(self, path: Path):
        self.path = path
        self._f = None  # opened when the run starts: a writer that never starts holds nothing open

    def on_start(self, run) -> None:
        self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 - open for the run, closed in on_end
        torn = self._f.tell() > 0 and _last_byte(self.path) != b"\n"
        if torn:  # a run killed mid-line: its torn record stays on a line of its own (read_jsonl skips it)
            self._f.write("\n")

    def on_log(self, record: dict) -> None:
        self._write({k: v for k, v in record.items() if k != COMPLETIONS})

    def _write(self, record: dict) -> None:
        # strict JSON: a non-finite value (the NaN loss of a step the guard skipped) is written as null
        strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        try:
            self._f.write(json.dumps(strict, allow_nan=False) + "\n")
        except OSError as e:  # a full disk: say which file
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def on_end(self, records: list[dict]) -> None:
        self.on_abort()

    def on_abort(self) -> None:
        if self._f is not None:
            self._f.close()


class TensorBoardWriter(Observer):
    """Every numeric field of a record as a scalar `train/<field>` at its step (tensorboardX events); a
    benchmark score as itself (eval/<task>/<metric>)."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self._w = None  # made when the run starts: tensorboardX closes writers at exit from a thread
        self._at_exit: list = []  # the close tensorboardX registered with atexit, which on_abort takes over

    def on_start(self, run) -> None:
        # A resume repeats the steps after its checkpoint: events a crashed start logged past it are
        # purged (TensorBoard's readers honour purge_step), so the curve runs forward with no step twice.
        # tensorboardX names a file by the second it was made, so a start within the same second as the
        # last one overwrote its file; the nanoseconds keep them apart, in the order they were made.
        writer_class, register = _summary_writer_class(), atexit.register

        def noting_ours(fn, *args, **kwargs):  # only the writer's own close, not a module's at first import
            if getattr(fn, "__qualname__", "").startswith("FileWriter."):
                self._at_exit.append(fn)
            return register(fn, *args, **kwargs)

        atexit.register = noting_ours
        try:
            self._w = writer_class(str(self.logdir), purge_step=run.at_step + 1,
                                   filename_suffix=f".{time.time_ns() % 10**9:09d}")
        finally:
            atexit.register = register

    def on_log(self, record: dict) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                # benchmark scores keep their own eval/<task>/<metric> names
                self._w.add_scalar(key if key.startswith("eval/") else f"train/{key}", value, record["step"])
        self._w.flush()

    def on_end(self, records: list[dict]) -> None:
        if self._w is not None:
            self._w.close()
        self._forget_at_exit()

    def on_abort(self) -> None:
        # after an error (a full disk) closing may fail too; tensorboardX's own close at exit would then
        # fail again and print its traceback under the error already reported
        with contextlib.suppress(Exception):
            if self._w is not None:
                self._w.close()
        self._forget_at_exit()

    def _forget_at_exit(self) -> None:
        for fn in self._at_exit:
            atexit.unregister(fn)
        self._at_exit.clear()


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without its torch probe (shard logs Python numbers) and
    without boto3, which it imports for S3 log dirs (a run's events are local): 0.1-0.25 s at start-up."""
    from shard.startup.imports import without

    with without("torch", "boto3"):
        from tensorboardX import SummaryWriter
    return SummaryWriter


def append_event(path: Path, event: dict) -> None:
    """Append an event record (`{"event": "resize", "time": ..., ...}`, docs/observing.md) to a metrics.jsonl,
    between jobs: on a line of its own even after a job killed mid-line, and strict JSON."""
    if "event" not in event or not _well_typed_event(event):
        raise ValueError(f"not an event record: {event}")
    with open(path, "a") as f:
        torn = f.tell() > 0 and _last_byte(Path(path)) != b"\n"
        f.write(("\n" if torn else "") + json.dumps(event, allow_nan=False) + "\n")


class CompletionsWriter(JsonlWriter):
    """completions.jsonl: a few of the completions a GRPO run sampled at each logged step, with their
    prompt's line and reward, one line a step."""

    def on_log(self, record: dict) -> None:
        if COMPLETIONS in record:
            self._write({"step": record["step"], COMPLETIONS: record[COMPLETIONS]})


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1)


def read_jsonl(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl; lines that are not records are skipped (see read_records)."""
    return read_records(path)[0]


def read_records(path: Path) -> tuple[list[dict], int]:
    """The step records of a metrics.jsonl, and how many lines were neither records nor events (torn by a
    crash, edited). Event records (`shard launch`'s, see read_events) are left out and not counted."""
    lines, skipped = read_lines(path)
    return [r for r in lines if not is_event(r)], skipped


def read_events(path: Path) -> list[dict]:
    """The event records of a metrics.jsonl (`{"event": "resize", "time": ...}`: what `shard launch` appends
    between jobs), in the order written; an event whose fields have the wrong type is left out."""
    return [r for r in read_lines(path)[0] if is_event(r)]


def read_lines(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """The step records and event records of a metrics.jsonl together, in the order written, and how many
    lines were neither; `offset`: those written after that many bytes (a size taken earlier)."""
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    out, skipped = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        if (record := _record_of(line)) is not None:
            out.append(record)
        else:
            skipped += 1
    return out, skipped


def holds_step_record(path: Path) -> bool:
    """Whether a metrics.jsonl holds a step record (not only events, or torn lines), read until the first."""
    with open(path, errors="replace") as f:
        return any((r := _record_of(line)) is not None and not is_event(r) for line in f if line.strip())


def _record_of(line: str) -> dict | None:
    """A line's record (a step record or an event, well typed), or None."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if isinstance(record, dict) and (_well_typed_event(record) if is_event(record) else _well_typed(record)):
        return record
    return None


def is_event(record: dict) -> bool:
    """An event record (a line `shard launch` wrote), not a step record: it has an `event` field."""
    return "event" in record


# The fields a record holds as numbers, which `report` computes with: always finite, or null where a
# value may not be (JsonlWriter writes a NaN loss as null).
NUMBER_FIELDS = ("step", "time_s", "tokens_per_s", "step_time_s", "tokens_seen", "mem_in_use_bytes",
                 "mem_peak_bytes")
NUMBER_OR_NULL_FIELDS = ("loss", "grad_norm", "lr", "mfu", "hfu", "eval_loss", "aux_loss", "router_z_loss", "pipeline_bubble",
                         "expert_load_min", "expert_load_max", "expert_load_cv", "tokens_dropped",
                         "expert_rows_sent", "mtp_loss", "max_logit")


def _well_typed(record: dict) -> bool:
    def number(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    return (all(number(record[k]) for k in NUMBER_FIELDS if k in record)
            and ("step" not in record or float(record["step"]).is_integer())
            and all(record[k] is None or number(record[k]) for k in NUMBER_OR_NULL_FIELDS if k in record))


# An event's fields that `report` computes with (the rest are shown as written).
EVENT_NUMBER_FIELDS = ("time", "held_s")
EVENT_INT_FIELDS = ("step", "processes", "steps_redone", "restarts")


def _well_typed_event(event: dict) -> bool:
    def number(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    recoveries = event.get("recoveries", [])
    return (isinstance(event["event"], str) and number(event.get("time"))
            and all(number(event[k]) for k in EVENT_NUMBER_FIELDS if k in event)
            and all(number(event[k]) and float(event[k]).is_integer() for k in EVENT_INT_FIELDS if k in event)
            and isinstance(recoveries, list) and all(isinstance(x, dict) for x in recoveries))
