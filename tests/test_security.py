"""What a hostile folder must not make shard do: run a planted `shard` package, or read files outside
a model folder or a token store."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import shard
from shard.cluster.coordinator import helper_command, helper_env
from shard.cluster.workers import worker_command
from shard.data.store import TokenStore, prepare_store
from shard.data.tokenizers import ByteTokenizer
from shard.errors import ShardError
from shard.run import hf
from shard.startup import xla_flags


_PLANTED = """open({marker!r}, "w").close()
import importlib, os, sys  # then step aside for the installed package, so that what imported this goes on
path = sys.path[:]
sys.path[:] = [p for p in path if os.path.abspath(p or os.curdir) != {folder!r}]
del sys.modules[__name__]
importlib.import_module(__name__)
sys.path[:] = path
"""


def _plant(folder, *packages):
    """Packages in `folder` that, once imported, leave a file named after themselves, then load the
    installed package in their place (a pool's worker that failed to start would be restarted forever)."""
    for name in packages:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(_PLANTED.format(marker=str(folder / f"ran-{name}"),
                                                                   folder=str(folder)))
    return lambda: sorted(p.name for p in folder.glob("ran-*"))


def test_no_helper_imports_a_package_from_the_working_directory(tmp_path, monkeypatch):
    """Every Python shard starts (the XLA-flag probe, the coordinator, a worker, a spawned tokenizing
    worker) runs with -P or PYTHONSAFEPATH: a planted `jax/`, `shard/` or `multiprocessing/` never runs."""
    work = tmp_path / "work"
    ran = _plant(work, "jax", "shard", "multiprocessing")
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing cached: the probe runs
    assert xla_flags.unknown_to_xla(["--xla_gpu_no_such_flag=true"]) == ["--xla_gpu_no_such_flag"]
    # the coordinator's helper: too few arguments, so the real module's main fails at once, having imported it
    done = subprocess.run(helper_command(), capture_output=True, text=True, env=helper_env(), timeout=60)
    assert "not enough values to unpack" in done.stderr, done.stderr
    assert subprocess.run([*worker_command(), "--help"], capture_output=True, timeout=60).returncode == 0
    # data prepare's workers, spawned (this process holds JAX)
    (tmp_path / "texts").mkdir()
    for name in "ab":  # two chunks, two workers
        (tmp_path / "texts" / f"{name}.txt").write_text("a planted package never runs\n" * 64)
    prepare_store(str(tmp_path / "texts"), ByteTokenizer(), tmp_path / "store", workers=2, progress=False,
                  chunk_bytes=512)
    assert ran() == []
    # the test can fail: a plain `python -m` from this folder runs what is planted
    subprocess.run([sys.executable, "-c", "import multiprocessing, jax, shard"], capture_output=True, timeout=60)
    assert ran() == ["ran-jax", "ran-multiprocessing", "ran-shard"]


def test_every_helper_command_line_has_safe_path():
    """A new helper started with sys.executable must say -P too (the re-exec for huge pages repeats the
    user's own command line, its flags included)."""
    root = Path(shard.__file__).parent
    lines = [(p, line) for p in root.rglob("*.py") for line in p.read_text().splitlines()
             if "[sys.executable," in line and not line.lstrip().startswith("#")]
    unsafe = [f"{p.relative_to(root)}: {line.strip()}" for p, line in lines
              if '"-P"' not in line and p.name != "host_memory.py"]
    assert len(lines) >= 3 and unsafe == []


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.safetensors").write_bytes(b"secret")
    return root


@pytest.mark.parametrize("entry", ["../outside/x.safetensors", "/etc/passwd", "link.safetensors"])
def test_a_weight_map_may_name_only_the_folders_own_files(folder, entry):
    (folder / "link.safetensors").symlink_to(folder.parent / "outside" / "x.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": entry}}))
    with pytest.raises(ShardError, match="which is outside") as e:
        hf.read_hf_dir(str(folder))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("entry", ["../outside/tokens.bin", "ABSOLUTE", "link.bin"])
def test_a_token_store_may_name_only_its_own_files(tmp_path, entry):
    (tmp_path / "text.txt").write_text("a secret is kept in its own folder\n" * 4)
    store = prepare_store(str(tmp_path / "text.txt"), ByteTokenizer(), tmp_path / "store", workers=1, progress=False)
    outside = tmp_path / "outside"
    outside.mkdir()
    shard = store.meta["shards"][0]
    (outside / "tokens.bin").write_bytes((store.path / shard["tokens"]).read_bytes())  # the size store.json says
    (store.path / "link.bin").symlink_to(outside / "tokens.bin")
    entry = str(outside / "tokens.bin") if entry == "ABSOLUTE" else entry
    meta = json.loads((store.path / "store.json").read_text())
    meta["shards"][0]["tokens"] = entry
    (store.path / "store.json").write_text(json.dumps(meta))
    with pytest.raises(ShardError, match=f"store.json's shards\\[0\\].tokens names {entry}, which is outside the "
                                         "store") as e:
        TokenStore.open(store.path)
    assert "\n" not in str(e.value)
