"""The persistent compilation cache hits in a new process, also for custom-partitioned programs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = Path(__file__).parent / "helpers" / "custom_partitioned_program.py"


def entries_after_each_run(cache: Path, runs: int, **env) -> list[int]:
    counts = []
    for _ in range(runs):
        r = subprocess.run([sys.executable, str(PROGRAM), str(cache)], env={**os.environ, **env},
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0 and r.stdout.strip() == "56.0", r.stderr[-2000:]
        counts.append(len(list(cache.iterdir())))
    return counts


@pytest.mark.parametrize("user_setting, hits", [(None, True), ("false", False)])
def test_a_new_process_reads_the_cached_program(tmp_path, user_setting, hits):
    env = {} if user_setting is None else {"JAX_REMOVE_CUSTOM_PARTITIONING_PTR_FROM_CACHE_KEY": user_setting}
    first, second = entries_after_each_run(tmp_path / "cache", 2, **env)
    assert first > 0
    # A hit adds nothing. With the partitioning callback's address in the key (JAX's default, kept when
    # the user sets it), every process misses and writes the program again.
    assert (second == first) is hits


def test_another_length_or_learning_rate_lowers_to_the_same_step():
    """The schedule's numbers are arguments of the step, not constants of its program, so a run with
    another --steps, lr or warm-up reads the program the first one cached."""
    from shard.training.compiled import lower_step
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.testing import devices_for, tiny_config

    programs = []
    for steps, lr, warmup in ((2, 3e-4, 10), (500, 1e-3, 1)):
        cfg = tiny_config("2x4", steps=steps, optimizer__lr=lr, optimizer__warmup_steps=warmup)
        programs.append(lower_step(cfg, make_layout(cfg, parse_mesh("2x4"), devices_for("2x4"))).as_text())
    assert programs[0] == programs[1]


CACHED_PROGRAM = """
import resource, signal, sys
from pathlib import Path
if len(sys.argv) > 2:  # no file may grow past this many bytes: a disk that fills up
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write past it fails (EFBIG) instead of the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
import jax, jax.numpy as jnp
from shard.startup.compile_cache import use_compile_cache
use_compile_cache(Path(sys.argv[1]))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # this small program is cached too
jax.block_until_ready(jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((8, 8))))
print("ok")
"""


def run_cached(cache: Path, file_limit: int | None = None) -> subprocess.CompletedProcess:
    """CACHED_PROGRAM in a new process, with shard's compile cache in `cache`."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    limit = [str(file_limit)] if file_limit else []
    r = subprocess.run([sys.executable, "-c", CACHED_PROGRAM, str(cache), *limit], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    return r


def test_an_entry_a_killed_write_cut_short_is_removed_and_written_again(tmp_path):
    """JAX writes entries in place and never over an existing one: a truncated entry (a kill -9 or a
    full disk during the write) was read, warned about and compiled again at every later start."""
    cache = tmp_path / "cache"
    run_cached(cache)
    entries = {p: p.read_bytes() for p in cache.glob("*-cache")}
    assert entries
    for p, whole in entries.items():
        p.write_bytes(whole[: len(whole) // 2])  # what a write killed half-way leaves
    r = run_cached(cache)
    for p in entries:
        assert f"removed an unreadable compile cache entry {p} (" in r.stderr, r.stderr
    assert "Error reading persistent compilation cache" not in r.stderr, r.stderr
    assert {p: p.read_bytes() for p in cache.glob("*-cache")} == entries  # written whole again
    assert run_cached(cache).stderr == ""  # and read: nothing removed, nothing warned


def test_a_write_the_full_disk_cuts_short_leaves_no_entry_and_names_its_path(tmp_path):
    cache = tmp_path / "cache"
    r = run_cached(cache, file_limit=1000)
    assert "Error writing persistent compilation cache entry" in r.stderr, r.stderr
    assert f"File too large: '{cache}/" in r.stderr, r.stderr  # the entry's path
    assert list(cache.iterdir()) == []  # neither a truncated entry nor the temporary file
    r = run_cached(cache)
    assert r.stderr == "" and list(cache.glob("*-cache")), r.stderr
