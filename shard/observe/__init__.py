"""What a run shows: the console, progress lines, metrics files and reports."""

from shard._api import lazy_api

__getattr__, __dir__, __all__ = lazy_api("shard.observe", {
    "JsonlWriter": "shard.observe.metrics", "TensorBoardWriter": "shard.observe.metrics",
    "read_jsonl": "shard.observe.metrics", "read_events": "shard.observe.metrics",
    "append_event": "shard.observe.metrics", "ConsoleProgress": "shard.observe.progress",
    "warn": "shard.observe.console", "note": "shard.observe.console",
})
