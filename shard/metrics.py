"""Where logged metrics go: metrics.jsonl in the run directory (one JSON object per logged step)."""

import json
from pathlib import Path


class JsonlWriter:
    """Appends each logged record as one line; flushed per line so a crash loses nothing logged."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a", buffering=1)

    def on_log(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")

    def on_end(self, records: list[dict]) -> None:
        self._f.close()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
