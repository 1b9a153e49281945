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
