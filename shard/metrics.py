"""Where logged metrics go: metrics.jsonl (one JSON object per logged step) and TensorBoard events."""

import json
import math
from pathlib import Path


class JsonlWriter:
    """Appends each logged record as one line; flushed per line so a crash loses nothing logged."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - open for the run, closed in on_end

    def on_log(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")

    def on_end(self, records: list[dict]) -> None:
        self._f.close()


class TensorBoardWriter:
    """Every numeric field of a record as a scalar `train/<field>` at its step (tensorboardX events)."""

    def __init__(self, logdir: Path):
        self._w = _summary_writer_class()(str(logdir))

    def on_log(self, record: dict) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._w.add_scalar(f"train/{key}", value, record["step"])
        self._w.flush()

    def on_end(self, records: list[dict]) -> None:
        self._w.close()


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without its torch probe (shard logs Python numbers)."""
    from shard.imports import without

    with without("torch"):
        from tensorboardX import SummaryWriter
    return SummaryWriter


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
