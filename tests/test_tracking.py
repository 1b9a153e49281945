"""Weights & Biases tracking: a run logs to an offline W&B run (read back from its .wandb file), a resume
continues that run, and asking for it without wandb installed is one line."""

import json
import math
import struct
import sys

import pytest
from typer.testing import CliRunner

from shard.cli.app import app
from shard.observe.metrics import read_jsonl

TINY = ["--model", "tiny", "--steps", "2", "--batch", "8", "--seq", "32", "--mesh", "8x1", "--log-every", "1",
        "--compile-cache", "none"]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")


def invoke(*args):
    return CliRunner().invoke(app, list(args))


def wandb_records(path) -> list:
    """The protobuf records of an offline run's .wandb file (a LevelDB-style log: 32 KiB blocks of
    chunks, each with a 7-byte header: crc, length, type; full=1, first=2, middle=3, last=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, chunks, records = path.read_bytes(), 7, 32768, [], []  # 7: the file's own header
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def offline_run(run_dir, nth: int = 0) -> dict:
    """The run id, history rows, summary, config and exit code of the run dir's nth offline W&B start."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    out = {"history": [], "summary": {}, "config": {}, "exit_code": None, "starts": len(files)}
    for r in wandb_records(files[nth]):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["id"] = r.run.run_id
            out["config"] = {u.key: json.loads(u.value_json) for u in r.run.config.update}
            out["name"], out["tags"], out["project"] = r.run.display_name, list(r.run.tags), r.run.project
        elif kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        elif kind == "summary":
            out["summary"].update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in r.summary.update})
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    return out


def test_train_logs_to_wandb_and_a_resume_continues_the_run(tmp_path, offline):
    run = tmp_path / "run"
    first = invoke("train", *TINY, "--run-dir", str(run), "--wandb", "proj", "--set", "tracking.tags=a,b",
                   "--set", "tracking.name=tiny-run")
    assert first.exit_code == 0, first.output
    saved_id = (run / "wandb_id").read_text().strip()
    logged = offline_run(run)
    assert (logged["project"], logged["name"], logged["tags"]) == ("proj", "tiny-run", ["a", "b"])
    assert logged["id"] == saved_id and logged["exit_code"] == 0
    assert logged["config"]["model"]["name"] == "tiny" and logged["config"]["tracking"]["project"] == "proj"
    records = read_jsonl(run / "metrics.jsonl")  # metrics.jsonl and TensorBoard as before
    assert [r["step"] for r in records] == [1, 2] and list((run / "tb").iterdir())
    history = [h for h in logged["history"] if "loss" in h]
    assert [(h["_step"], h["loss"]) for h in history] == [(r["step"], r["loss"]) for r in records]
    assert history[0]["tokens_per_s"] == records[0]["tokens_per_s"]
    summary = logged["summary"]
    assert summary["mesh/shape"]["data"] == 8 and math.prod(summary["mesh/shape"].values()) == 8
    assert "data" in summary["layout/rules"]["batch"]
    assert summary["model/params"] > 0 and summary["memory/compiled_total_bytes"] > 0
    assert any(k.startswith("report/loss_vs_step") for k in summary)  # shard report's plots

    # --resume reads the project from the run's config and continues the same W&B run
    resumed = invoke("train", "--run-dir", str(run), "--resume", "--steps", "3", "--compile-cache", "none")
    assert resumed.exit_code == 0, resumed.output
    again = offline_run(run, nth=1)
    assert again["starts"] == 2 and again["id"] == saved_id and again["exit_code"] == 0
    assert [h["_step"] for h in again["history"] if "loss" in h] == [3]


def test_wandb_without_the_package_is_one_line(tmp_path, offline, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    run = tmp_path / "run"
    result = invoke("train", *TINY, "--run-dir", str(run), "--wandb", "proj")
    assert result.exit_code == 2, result.output
    assert result.output.strip() == "error: --wandb needs wandb: ./install.sh wandb"
    assert not run.exists()  # before the run dir, let alone a compile


def test_a_tracking_mode_wandb_does_not_know_is_refused():
    from shard import config
    from shard.errors import ShardError

    assert config.resolve(config.parse_sets(["tracking.tags=a,b"])).tracking.tags == ("a", "b")
    with pytest.raises(ShardError, match="tracking.mode must be online, offline, disabled"):
        config.resolve(config.parse_sets(["tracking.mode=ofline"]))


def test_a_wandb_run_that_cannot_start_is_one_line(tmp_path, offline, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", refuse)
    result = invoke("train", *TINY, "--mesh", "8x1", "--wandb", "proj", "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    assert "W&B could not start a run for project 'proj' (api_key not configured" in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[-1] == result.output.strip().splitlines()[-1]
    assert "Traceback" not in result.output
