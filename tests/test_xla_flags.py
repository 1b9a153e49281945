"""XLA flag presets: never override the user's flags, and every flag exists in the installed XLA."""

import os
import subprocess
import sys

from shard import xla_flags


def test_preset_only_on_gpu_and_user_flags_win():
    user = "--xla_gpu_enable_latency_hiding_scheduler=false --foo=1"
    merged = xla_flags.merged_flags(user, gpu=True, gpu_preset=True, deterministic=False)
    assert merged.startswith(user)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in merged
    assert "--xla_gpu_enable_pipelined_all_gather=true" in merged
    assert xla_flags.merged_flags(user, gpu=False, gpu_preset=True, deterministic=False) == user
    det = xla_flags.merged_flags("", gpu=False, gpu_preset=True, deterministic=True)
    assert "--xla_gpu_deterministic_ops=true" in det


def test_every_flag_is_known_to_the_installed_xla():
    # XLA aborts at start-up on an unknown flag, so a renamed flag would break every GPU run.
    flags = xla_flags.merged_flags("", gpu=True, gpu_preset=True, deterministic=True)
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices()))"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
