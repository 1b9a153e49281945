"""One of two processes resuming a tiny 2x4 run from a checkpoint (used by tests/test_checkpoint.py).

    python two_process_resume.py PROCESS_ID PORT RUN_DIR STEPS

Each process simulates 4 CPU devices; jax.distributed joins them into one 8-device 2x4 mesh. The run
restores the newest checkpoint of RUN_DIR into this mesh, trains to STEPS saving every 2 steps, and
process 0 prints the losses as JSON.
"""

import json
import os
import sys
from pathlib import Path

process_id, port, run_dir, steps = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

from shard import config as config_mod  # noqa: E402
from shard.checkpoint import CHECKPOINTS_DIR, Checkpoints, SaveCheckpoints  # noqa: E402
from shard.loop import prepare, train  # noqa: E402
from shard.testing import tiny_config  # noqa: E402

cfg = tiny_config("2x4", steps=steps, checkpoint__every=2, checkpoint__keep=10)
checkpoints = Checkpoints(run_dir / CHECKPOINTS_DIR, cfg.checkpoint, notice=print)
run = prepare(cfg, restore=checkpoints.restore_latest)
assert jax.process_count() == 2 and len(run.mesh.devices.flat) == 8
saver = SaveCheckpoints(checkpoints, seed=cfg.seed, config_toml=config_mod.to_toml(cfg))
records = train(cfg, run=run, observers=[saver])
checkpoints.close()
if process_id == 0:
    print(json.dumps({"start_step": run.start_step, "losses": [r["loss"] for r in records]}))
