"""Checkpoint throughput and async-save overhead; prints figures, never passes or fails.

    python benchmarks/checkpoint.py                       # ~57M-param model (0.7 GB train state), 8 CPU devices
    python benchmarks/checkpoint.py --set model.d_model=1024 --mesh fsdp --dir /fast/disk

1. save: orbax async save of the whole train state, from the call to the commit (GB/s);
2. restore: back into the same shardings (GB/s);
3. raw: one sequential write of the same bytes to one file in the same directory, buffered and with
   fsync (GB/s), the ceiling the disk offers;
4. overhead: mean step time of a training run that saves every K steps vs the same run without saves,
   and the time save() blocks the loop (copying the arrays off the devices) per save; these runs use a
   short sequence (--overhead-seq) so that they finish on a laptop CPU.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="fsdp")
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config overrides (key=value)")
    ap.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="steps of each overhead run")
    ap.add_argument("--overhead-seq", type=int, default=16,
                    help="sequence length of the overhead runs (short, so that a 2-core CPU gets through them)")
    ap.add_argument("--every", type=int, default=4, help="save every K steps in the overhead run")
    a = ap.parse_args()

    from shard.startup.devices import request_host_devices

    request_host_devices(a.devices)
    import dataclasses

    import jax
    import numpy as np

    from shard import Checkpoints, SaveCheckpoints, config, prepare, train

    sets = ["model.name=small", "model.d_model=768", "model.n_layers=6", "model.n_heads=12", "model.n_kv_heads=12",
            "model.head_dim=64", "model.mlp_dim=3072", "data.batch=8", "data.seq_len=128", "data.path=synthetic",
            f"mesh.spec={a.mesh}", f"steps={a.steps}", "log_every=1", *a.sets]
    cfg = config.resolve(config.parse_sets(sets))
    root = Path(tempfile.mkdtemp(prefix="shard-ckpt-bench-", dir=a.dir))
    try:
        run = prepare(cfg)
        state = run.state
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        print(f"model {cfg.model.num_params() / 1e6:.1f}M params · train state {nbytes / 1e9:.3f} GB on "
              f"mesh {dict(run.mesh.shape)} · {jax.device_count()} {jax.devices()[0].platform} devices · dir {root}")

        ckpts = Checkpoints(root / "ckpt", dataclasses.replace(cfg.checkpoint, keep=1))
        saves, blocks, restores = [], [], []
        for i in range(a.repeats):
            t0 = time.perf_counter()
            ckpts.save(i + 1, state, position=0, seed=0, config_toml="")
            t1 = time.perf_counter()
            ckpts.wait()
            saves.append(time.perf_counter() - t0)
            blocks.append(t1 - t0)
            t0 = time.perf_counter()
            restored = ckpts.restore(i + 1, run.spec)
            jax.block_until_ready(restored.state)
            restores.append(time.perf_counter() - t0)
            del restored
        ckpts.close()

        host = [np.asarray(x) for x in jax.tree.leaves(state)]
        raw, raw_sync = [], []
        for i in range(a.repeats):
            for sync, out in ((False, raw), (True, raw_sync)):
                path = root / f"raw-{i}-{int(sync)}.bin"
                t0 = time.perf_counter()
                with open(path, "wb") as f:
                    f.writelines(memoryview(np.ascontiguousarray(x)).cast("B") for x in host)
                    if sync:
                        f.flush()
                        os.fsync(f.fileno())
                out.append(time.perf_counter() - t0)
                path.unlink()
        del host

        gb = nbytes / 1e9
        best = min  # the least disturbed of the repeats (shared machines are noisy)
        print(f"save     {gb / best(saves):6.2f} GB/s   ({best(saves):.2f} s to commit; save() blocked "
              f"{best(blocks):.3f} s)")
        print(f"restore  {gb / best(restores):6.2f} GB/s   ({best(restores):.2f} s)")
        print(f"raw      {gb / best(raw):6.2f} GB/s buffered, {gb / best(raw_sync):.2f} GB/s with fsync")
        print(f"save / raw write: {best(raw) / best(saves):.0%} of buffered, {best(raw_sync) / best(saves):.0%} "
              "of fsync'd")

        del run, state
        short = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=a.overhead_seq))

        def step_times(observers) -> list[float]:
            r = prepare(short)
            records = train(short, run=r, observers=observers)
            return [rec["step_time_s"] for rec in records[1:]]  # the first step includes warm-up

        base = step_times([])
        ckpts = Checkpoints(root / "overhead", dataclasses.replace(cfg.checkpoint, every=a.every, keep=1))
        timed = TimedSaves(SaveCheckpoints(ckpts, seed=0, config_toml=""))
        with_saves = step_times([timed])
        ckpts.close()
        m0, m1 = float(np.mean(base)), float(np.mean(with_saves))
        print(f"step time {m0 * 1e3:.1f} ms without saves, {m1 * 1e3:.1f} ms saving every {a.every} steps: "
              f"overhead {(m1 - m0) / m0:+.1%} of step time; save() blocks {np.mean(timed.blocked) * 1e3:.1f} ms "
              f"per save ({np.mean(timed.blocked) / a.every / m0:.1%} of step time amortised)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


class TimedSaves:
    """Wraps SaveCheckpoints to time how long each save() blocks the loop."""

    def __init__(self, inner):
        self.inner, self.blocked = inner, []

    def on_state(self, step, state, position, metrics, final):
        t0 = time.perf_counter()
        saved = self.inner.last_saved
        self.inner.on_state(step, state, position, metrics, final)
        if self.inner.last_saved != saved:
            self.blocked.append(time.perf_counter() - t0)

    def on_end(self, records):
        self.inner.on_end(records)


if __name__ == "__main__":
    sys.exit(main())
