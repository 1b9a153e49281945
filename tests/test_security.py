"""What a hostile folder must not make shard do: run a planted `shard` package, or read files outside
a model folder or a token store."""

import json
import subprocess
import sys

import pytest

from shard.cluster.coordinator import helper_command, helper_env
from shard.data.store import TokenStore, prepare_store
from shard.data.tokenizers import ByteTokenizer
from shard.errors import ShardError
from shard.run import hf


def test_the_coordinator_helper_never_imports_a_shard_package_from_the_working_directory(tmp_path):
    planted = tmp_path / "shard"
    (planted / "cluster").mkdir(parents=True)
    marker = tmp_path / "ran"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('planted')\n")
    (planted / "cluster" / "__init__.py").write_text("")
    (planted / "cluster" / "coordinator.py").write_text("")
    # the old command line (python -m from this folder) ran the planted package: the test can fail
    subprocess.run([sys.executable, "-m", "shard.cluster.coordinator"], cwd=tmp_path, capture_output=True,
                   env=helper_env(), timeout=60)
    assert marker.exists()
    marker.unlink()
    # the helper's own: too few arguments, so the real module's main fails at once, having imported it
    done = subprocess.run(helper_command(), cwd=tmp_path, capture_output=True, text=True, env=helper_env(), timeout=60)
    assert not marker.exists()
    assert "not enough values to unpack" in done.stderr, done.stderr


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
