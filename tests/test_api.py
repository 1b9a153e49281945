"""The public API: every name shard/__init__.py lists resolves, and `import shard` loads no JAX (the CLI
sets the simulated device count after it); nor do the CLI's modules and what `shard plan` reads."""

import subprocess
import sys

import shard


def test_import_shard_loads_no_jax_and_every_listed_name_resolves():
    code = ("import sys, shard, shard.config, shard.cli.app, shard.measure.plan, shard.measure.hlo\n"
            "assert 'jax' not in sys.modules, 'importing them loaded jax'\n"
            "missing = [n for n in shard.__all__ if getattr(shard, n, None) is None]\n"
            "assert not missing, missing\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_public_names_are_the_library_objects():
    from shard.config.resolve import resolve
    from shard.training.loop import train

    assert shard.train is train and shard.config.resolve is resolve
    assert set(shard.__all__) <= set(dir(shard))
    try:
        shard.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no attribute 'no_such_name'" in str(e)
    else:
        raise AssertionError("an unknown name resolved")
