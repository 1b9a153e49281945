"""XLA flag presets: never override the user's flags, and every flag exists in the installed XLA."""

import os
import subprocess
import sys

from shard.startup import xla_flags


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


def test_a_flag_this_xla_does_not_know_is_left_out_once_probed(monkeypatch, tmp_path):
    """XLA aborts at start-up on an unknown flag: a preset flag a newer (or older) XLA renamed is left
    out instead, found by one probe per jaxlib, whose answer later starts read from the cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    monkeypatch.setattr(xla_flags, "gpu_expected", lambda: True)
    monkeypatch.setitem(xla_flags.GPU_PRESET, "--xla_gpu_retired_flag", ("true", "a flag this XLA lacks"))
    assert xla_flags.apply(gpu_preset=True, deterministic=False) == ["--xla_gpu_retired_flag"]
    flags = os.environ["XLA_FLAGS"]
    assert flags.startswith("--xla_gpu_enable_latency_hiding_scheduler=false ")  # the user's, first and kept
    assert "--xla_gpu_enable_pipelined_all_gather=true" in flags and "retired" not in flags
    assert (tmp_path / "shard" / "xla_flags.json").is_file()

    def no_probe(*args, **kwargs):
        raise AssertionError("probed again")

    monkeypatch.setattr(xla_flags.subprocess, "run", no_probe)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    assert xla_flags.apply(gpu_preset=True, deterministic=False) == ["--xla_gpu_retired_flag"]
    assert os.environ["XLA_FLAGS"] == flags


def test_a_deterministic_gpu_run_needs_every_deterministic_flag(monkeypatch, tmp_path):
    import pytest

    from shard.errors import ShardError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(xla_flags, "gpu_expected", lambda: True)
    monkeypatch.setitem(xla_flags.DETERMINISTIC, "--xla_gpu_retired_deterministic_flag", ("true", ""))
    with pytest.raises(ShardError, match="does not know --xla_gpu_retired_deterministic_flag, so the run would not"):
        xla_flags.apply(gpu_preset=True, deterministic=True)
    monkeypatch.setattr(xla_flags, "gpu_expected", lambda: False)  # on CPU the deterministic flags do nothing
    assert xla_flags.apply(gpu_preset=True, deterministic=True) == ["--xla_gpu_retired_deterministic_flag"]


def test_a_cache_folder_that_cannot_be_written_only_costs_a_probe(monkeypatch, tmp_path):
    (tmp_path / "shard").write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setitem(xla_flags.GPU_PRESET, "--xla_gpu_retired_flag", ("true", ""))
    flags = xla_flags.added_flags("", gpu=True, gpu_preset=True, deterministic=False)
    assert xla_flags.unknown_to_xla(flags) == ["--xla_gpu_retired_flag"]
    assert (tmp_path / "shard").is_file()
