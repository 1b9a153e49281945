"""One place sets the simulated devices (8 CPU devices) and the shared compilation cache.

Both are environment variables, so `shard` subprocesses started by tests inherit them.
"""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from shard.testing import subprocess_env, xla_flags_for_tests  # imports no JAX

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags_for_tests(8)).strip()
_CACHE = Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# no matmul peak (benchmarks/peak.py's cache): this machine's would turn MFU on in every CPU run
os.environ["SHARD_PEAK_FILE"] = str(_CACHE.parent / "no-such-peak.json")

import jax  # noqa: E402
import pytest  # noqa: E402

assert jax.device_count() == 8, "tests expect 8 simulated CPU devices; JAX started before conftest"

# The files that take longest, longest first (seconds on two busy cores: 340, 96, 89, 84, 83, 68, 42, 41;
# no other file takes 25). Each file runs whole on one worker (--dist loadfile), so these start first and
# the short files even out the workers' ends; xdist's own order (most tests first) leaves the notebooks
# and the long runs of test_train and test_benchmarks for last. Insurance against a long file left to the
# end, not a measured gain: a cold clean clone took 1,000 s in this order and 995 s in xdist's.
LONGEST_FIRST = ["test_multiprocess.py", "test_elastic.py", "test_notebooks.py", "test_benchmarks.py", "test_checkpoint.py",
                 "test_train.py", "test_cli.py", "test_observe.py", "test_parallel.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture
def run_shard(tmp_path):
    """Run the real `shard` CLI in a subprocess (for what needs a fresh JAX: device simulation)."""
    import subprocess
    import sys

    def run(*args, timeout=300, shared_cache=True):
        env = subprocess_env()  # the CLI chooses the device count, as in a user's shell
        if not shared_cache:
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
        return subprocess.run([sys.executable, "-m", "shard", *args], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=timeout)

    return run
