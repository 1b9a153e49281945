"""The default run learns."""

import dataclasses
import os
import subprocess
import sys

import numpy as np

from shard import config
from shard.training.loop import train
from shard.observe.metrics import read_jsonl


def test_default_run_loss_falls_over_20_steps(tmp_path):
    """The README's main command, `shard train`, for 20 steps: the default model on the embedded corpus.
    In a process of its own with XLA's default flags, as a user runs it (this is the suite's longest run)."""
    default = config.resolve({})
    assert default.model.name == "small" and default.data.path == ""
    env = {**os.environ, "XLA_FLAGS": ""}  # the CLI simulates the devices
    r = subprocess.run([sys.executable, "-m", "shard", "train", "--steps", "20", "--log-every", "1", "--run-dir", "r"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [rec["loss"] for rec in read_jsonl(tmp_path / "r" / "metrics.jsonl")]
    assert len(losses) == 20 and np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses


def test_a_long_log_interval_does_not_deadlock_the_cpu_collectives(tmp_path):
    """With 8 simulated devices, hundreds of steps dispatched between host syncs deadlocked XLA:CPU's
    in-process all-reduce and aborted natively (3 runs out of 3 on 2 cores); the loop now keeps at most
    MAX_STEPS_AHEAD steps in flight. Small steps, for speed: without the bound, this run still aborts
    (3 out of 3), where 100 steps did not."""
    env = {**os.environ, "XLA_FLAGS": ""}
    r = subprocess.run([sys.executable, "-m", "shard", "train", "--model", "tiny", "--steps", "300", "--log-every",
                        "300", "--batch", "8", "--seq", "32", "--run-dir", "r"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [rec["step"] for rec in read_jsonl(tmp_path / "r" / "metrics.jsonl")] == [300]


def test_the_loop_compiles_nothing_after_prepare():
    """The train step is compiled once, ahead of time; steps, logging and the data path add no compiles."""
    import jax

    from shard.training.prepare import prepare
    from shard.testing import devices_for, tiny_config

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None)
    cfg = tiny_config("2x4", steps=4, log_every=2)
    run = prepare(cfg, devices_for("2x4"))
    assert compiles, "the listener saw no compile at all"
    before = len(compiles)
    train(cfg, run=run)
    assert len(compiles) == before
    # a second call (a notebook cell run again) goes on from the step the state holds: it retrained
    # from step 1 on the trained state, and labelled the steps and tokens as a fresh start's
    assert train(cfg, run=run) == []
    more = train(dataclasses.replace(cfg, steps=6), run=run)
    assert [r["step"] for r in more] == [6] and more[0]["tokens_seen"] == 6 * 8 * 32
    assert int(run.state["step"]) == 6
