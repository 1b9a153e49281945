"""One of two processes resuming a tiny 2x4 run from a checkpoint (used by tests/test_checkpoint.py).

    python two_process_resume.py PROCESS_ID PORT RUN_DIR STEPS SIGNAL_AT

Each process simulates 4 CPU devices; jax.distributed joins them into one 8-device 2x4 mesh. The run
restores the newest checkpoint of RUN_DIR into this mesh and trains to STEPS saving every 2 steps;
process 1 alone gets a SIGTERM while step SIGNAL_AT runs, so both must stop after the same step and
save it. Process 0 prints the start step, the step it stopped at and the losses as JSON.
"""

import json
import os
import signal
import sys
from pathlib import Path

process_id, port, run_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
steps, signal_at = int(sys.argv[4]), int(sys.argv[5])
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

from shard import config as config_mod  # noqa: E402
from shard.paths import CHECKPOINTS_DIR  # noqa: E402
from shard.run.checkpoint import Checkpoints, SaveCheckpoints  # noqa: E402
from shard.training.prepare import prepare  # noqa: E402
from shard.training.loop import train  # noqa: E402
from shard.training.preemption import StopOnSignal  # noqa: E402
from shard.testing import tiny_config  # noqa: E402
from shard.training.observer import Observer  # noqa: E402

cfg = tiny_config("2x4", steps=steps, checkpoint__every=2, checkpoint__keep=10)
checkpoints = Checkpoints(run_dir / CHECKPOINTS_DIR, cfg.checkpoint, notice=print)
run = prepare(cfg, restore=checkpoints.restore_latest)
assert jax.process_count() == 2 and len(run.mesh.devices.flat) == 8
saver = SaveCheckpoints(checkpoints, seed=cfg.seed, config_toml=config_mod.to_toml(cfg))


class SignalAt(Observer):
    def on_step(self, step: int, outputs=None) -> None:
        if process_id == 1 and step == signal_at - 1:  # the loop is on to step `signal_at`
            os.kill(os.getpid(), signal.SIGTERM)


records = train(cfg, run=run, observers=[SignalAt(), saver, StopOnSignal()])
checkpoints.close()
result = {"start_step": run.start_step, "stopped_at": run.stopped_at, "losses": [r["loss"] for r in records]}
print(json.dumps(result))
