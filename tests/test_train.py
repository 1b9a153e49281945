"""The default run learns."""

import numpy as np

from shard import config
from shard.loop import train


def test_default_run_loss_falls_over_50_steps():
    cfg = config.resolve({"steps": 50, "log_every": 1})
    assert cfg.model.name == "small" and cfg.data.path == ""  # the default model on the embedded corpus
    losses = [r["loss"] for r in train(cfg)]
    assert len(losses) == 50 and np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses


def test_the_loop_compiles_nothing_after_prepare():
    """The train step is compiled once, ahead of time; steps, logging and the data path add no compiles."""
    import jax

    from shard.loop import prepare
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
