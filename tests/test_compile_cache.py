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
