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
