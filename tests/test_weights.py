"""Weights in and out through the CLI: import-hf, generate, export-hf and train --init-from, on a Hugging
Face folder that shard writes itself (no torch needed; tests/test_hf.py checks against transformers)."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file
from typer.testing import CliRunner

from shard import config
from shard.run import hf, hf_side
from shard import models
from shard.cli.app import app
from shard.errors import ShardError
from shard.config.presets import PRESETS


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = dataclasses.replace(PRESETS["tiny"], n_kv_heads=4, tie_embeddings=False, name="tiny-gqa")
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(models.build(cfg, seed=7))))
    path = tmp_path_factory.mktemp("hf")
    hf.write_hf_dir(str(path), cfg, params)
    return path


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("imported") / "run"
    r = invoke("import-hf", hf_dir, "--out", out)
    assert r.exit_code == 0, r.output
    return out


def test_import_writes_the_weights_alone(imported):
    """A checkpoint of the weights without an optimizer state (which would triple what the import holds):
    --init-from starts a fresh one; --resume says so in one line."""
    assert (imported / "config.toml").is_file() and (imported / "checkpoints" / "0" / "state").is_dir()
    r = invoke("train", "--resume", "--run-dir", imported, "--steps", 1, "--mesh", "8x1")
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds weights only (no optimizer state: import-hf writes them so); train from them " \
        "with --init-from" in errors[0] and "Traceback" not in r.output, r.output


def test_generate_from_the_import_and_from_the_folder_agree(imported, hf_dir):
    a = invoke("generate", "--checkpoint", imported, "--prompt-ids", "5,17,99", "--max-new-tokens", 6,
               "--temperature", 0, "--ids", "--mesh", "8x1")
    b = invoke("generate", hf_dir, "--prompt-ids", "5,17,99", "--max-new-tokens", 6,  # positional, as export-hf
               "--temperature", 0, "--ids", "--mesh", "2x4")
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    tokens = a.output.split()
    assert len(tokens) == 6 and all(0 <= int(t) < 256 for t in tokens)
    assert a.output.split() == b.output.split()


def test_text_prompt_streams_text(imported):
    r = invoke("generate", "--checkpoint", imported, "--prompt", "def f", "--max-new-tokens", 5,
               "--temperature", 0.7, "--top-k", 20, "--mesh", "8x1")
    assert r.exit_code == 0 and r.output.startswith("def f"), r.output
    # after the echo, the text of the very tokens sampled (bytes here): the same sampling as ids
    ids = invoke("generate", "--checkpoint", imported, "--prompt-ids", ",".join(str(b) for b in b"def f"),
                 "--max-new-tokens", 5, "--temperature", 0.7, "--top-k", 20, "--ids", "--mesh", "8x1")
    assert ids.exit_code == 0, ids.output
    sampled = [int(t) for t in ids.output.split()]
    assert len(sampled) == 5
    assert r.output.rstrip("\n") == "def f" + bytes(sampled).decode("utf-8", errors="replace"), (r.output, sampled)


def test_export_gives_back_the_same_tensors(imported, hf_dir, tmp_path):
    r = invoke("export-hf", "--checkpoint", imported, "--out", tmp_path / "out")  # as generate's option
    assert r.exit_code == 0, r.output
    before, after = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads"] == 4


def test_fine_tune_from_imported_weights_on_another_mesh(imported, tmp_path):
    # only the checkpoints folder, copied elsewhere: the model comes from the step's own saved config
    # (it was read from the run dir's config.toml, so a copied checkpoints/ could not be used)
    shutil.copytree(Path(imported) / "checkpoints", tmp_path / "copied")
    r = invoke("train", "--init-from", tmp_path / "copied", "--mesh", "2x4", "--steps", 2, "--batch", 8, "--seq", 32,
               "--run-dir", tmp_path / "ft", "--log-every", 1)
    assert r.exit_code == 0, r.output
    first = json.loads((tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()[0])
    # the imported model, not a fresh one: the first step's loss (computed before its update) is the
    # imported weights' own loss on the run's first batch, computed here apart from the trainer
    from shard import prepare
    from shard.run.weights import load, place
    from shard.training.step import make_eval_step

    cfg = config.resolve(config.load_file(str(tmp_path / "ft" / "config.toml")))
    run = prepare(cfg, restore=None)
    _, params = load(tmp_path / "copied")
    evaluate, batch = make_eval_step(run.spec, run.layout), run.stream.next()
    nll, count = evaluate(place(params, run.spec), batch)
    assert first["loss"] == pytest.approx(float(nll) / float(count), rel=1e-5)
    fresh_nll, _ = evaluate(run.state["params"], batch)  # the seed's fresh init (restore=None) reads otherwise
    assert abs(float(fresh_nll) - float(nll)) > 1e-3 * float(nll)


@pytest.mark.parametrize("model,mesh", [("tiny", "stage=2,fsdp=2,model=2"), ("moe-tiny", "data=2,expert=2,model=2")])
def test_a_lazy_stack_is_placed_one_hf_tensor_at_a_time_as_the_whole_stack_would_be(model, mesh):
    """A layer- or expert-stacked param of a Hugging Face folder goes onto the devices one HF tensor at a
    time (the host never holds a stack), into the same arrays and shardings as numpy's whole stack,
    where the stacked dims are themselves sharded (pipeline stages, experts)."""
    from shard.run.weights import place
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.testing import devices_for, tiny_config
    from shard.training.state import state_spec

    cfg = tiny_config(mesh, model__name=model, model__n_layers=4)  # two layers a stage: a device's shard is a stack
    spec = state_spec(cfg.model, cfg.optimizer, 1, make_layout(cfg, parse_mesh(mesh), devices_for(mesh)))
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s, np.float32) for n, s in hf.expected_hf_shapes(cfg.model).items()}
    lazy = hf.lazy_params_from_hf(tensors, cfg.model)
    stacks = {k: x for k, x in lazy["layers"].items() if x.tensor_dims}
    assert {x.tensor_dims for x in stacks.values()} == ({1, 2} if model == "moe-tiny" else {1})
    blocks = []
    for x in stacks.values():
        x._read = lambda index, read=x._read, k=x.tensor_dims: blocks.append(index[:k]) or read(index)
    placed = place(lazy, spec)
    assert blocks and all(s.start is not None and s.stop - s.start == 1 for index in blocks for s in index), blocks
    whole = place(jax.tree.map(np.asarray, lazy, is_leaf=lambda x: isinstance(x, hf.LazyParam)), spec)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(placed)[0], jax.tree.leaves(whole)):
        assert got.sharding == want.sharding, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))
    assert placed["layers"]["w_up"].sharding.spec[:2] == (("stage", "fsdp") if model == "tiny" else (None, "expert"))


def test_a_checkpoints_params_are_read_straight_into_their_shardings_and_checked(imported, tmp_path):
    """generate, eval and --init-from read a shard checkpoint's params with orbax straight into the mesh's
    shardings (no copy on the host): the same arrays as the host's read, checked against the saved
    checksums; np.asarray of one reads it on the host, checked too."""
    from shard.run.stored import StoredParam, read_params
    from shard.run.weights import load, place
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.testing import devices_for, tiny_config
    from shard.training.state import state_spec

    mesh = "fsdp=4,model=2"
    model_cfg, lazy = load(imported)
    assert all(isinstance(x, StoredParam) for x in jax.tree.leaves(lazy, is_leaf=lambda x: isinstance(x, hf.LazyParam)))
    cfg = dataclasses.replace(tiny_config(mesh), model=model_cfg)
    spec = state_spec(model_cfg, cfg.optimizer, 1, make_layout(cfg, parse_mesh(mesh), devices_for(mesh)))
    placed, host = place(lazy, spec), read_params(imported)[0]
    for (path, got), want, sharding in zip(jax.tree_util.tree_flatten_with_path(placed)[0], jax.tree.leaves(host),
                                           jax.tree.leaves(spec.shardings["params"])):
        assert got.sharding == sharding, path
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(path))
    np.testing.assert_array_equal(np.asarray(lazy["layers"]["wq"]), host["layers"]["wq"])
    damaged = tmp_path / "run"
    shutil.copytree(imported, damaged)
    meta = damaged / "checkpoints" / "0" / "meta" / "metadata"
    doc = json.loads(meta.read_text())
    doc["fingerprint"]["params/layers/wq"][0] ^= 1
    meta.write_text(json.dumps(doc))
    lazy = load(damaged)[1]
    for read in (lambda: place(lazy, spec), lambda: np.asarray(lazy["layers"]["wq"])):
        with pytest.raises(ShardError, match="params/layers/wq reads back other than it was saved"):
            read()


def test_a_hugging_face_folder_takes_a_presets_name_only_where_it_is_that_model(hf_dir, tmp_path):
    """Its model is named after the folder; --model may name the preset it is, and nothing else."""
    other = invoke("train", "--init-from", hf_dir, "--model", "tiny", "--steps", 1, "--run-dir", tmp_path / "a")
    assert other.exit_code == 2 and len(other.output.strip().splitlines()) == 1, other.output
    assert f"init_from {hf_dir} is another model than tiny (model.n_kv_heads is 4 there, " in other.output
    assert not (tmp_path / "a").exists()
    tiny = tmp_path / "tiny-export"
    hf.write_hf_dir(str(tiny), PRESETS["tiny"],
                    jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(models.build(PRESETS["tiny"], seed=3)))))
    same = invoke("train", "--init-from", tiny, "--model", "tiny", "--steps", 1, "--batch", 8, "--seq", 32,
                  "--run-dir", tmp_path / "b")
    assert same.exit_code == 0, same.output
    assert config.resolve(config.load_file(str(tmp_path / "b" / "config.toml"))).model.name == "tiny"


def test_a_sequence_beyond_the_weights_positions_is_said(hf_dir, tmp_path):
    """A fine-tune at --seq past config.json's max_position_embeddings trains on positions the model has
    never seen: said once, as MaxText users expect from HF-based tools."""
    short = tmp_path / "short"
    shutil.copytree(hf_dir, short)
    config = json.loads((short / "config.json").read_text()) | {"max_position_embeddings": 16}
    (short / "config.json").write_text(json.dumps(config))
    assert hf_side.context_note(short, 16) is None and hf_side.context_note(hf_dir, 32) is None  # 4096 positions
    r = invoke("train", "--init-from", short, "--mesh", "8x1", "--steps", 1, "--batch", 8, "--seq", 32,
               "--run-dir", tmp_path / "ft")
    assert r.exit_code == 0, r.output
    assert f"data.seq_len 32 is beyond the 16 positions {short} was made for" in r.output, r.output
    # generate samples past them too: said once, before the tokens
    r = invoke("generate", short, "--prompt-ids", "5,17,99", "--max-new-tokens", 20, "--temperature", 0, "--ids",
               "--mesh", "8x1")
    assert r.exit_code == 0, r.output
    said = f"the prompt and --max-new-tokens reach position 23, beyond the 16 positions {short} was made for"
    assert r.output.count(said) == 1 and len(r.output.split(said, 1)[1].split()) > 20, r.output


@pytest.mark.parametrize("args, message", [
    (["generate", "--checkpoint", "/nonexistent", "--prompt", "x"], "weights path /nonexistent does not exist"),
    (["generate", "--checkpoint", "/tmp", "--prompt", "x", "--prompt-ids", "1"], "exactly one of"),
    (["train", "--init-from", "/nonexistent", "--model", "tiny"], "--init-from: /nonexistent does not exist"),
    (["generate", "--checkpoint", "/tmp", "--prompt", "x", "--max-new-tokens", "-1"], "--max-new-tokens must be 0"),
    # past int64 it was a 77-line traceback from jnp (below, out of memory in one line)
    (["generate", "--checkpoint", "/tmp", "--prompt", "x", "--max-new-tokens", "99999999999999999999"],
     "--max-new-tokens must be 0 or more and below 2**31, got 99999999999999999999"),
    (["generate", "--checkpoint", "/tmp", "--prompt", "x", "--seed", "-1"], "--seed must be between 0 and 2**32-1"),
    (["generate", "--prompt", "x"], "give a checkpoint: a run dir, its checkpoints/ dir or one step's dir, as the "
                                    "first argument or as --checkpoint"),
    (["export-hf", "/tmp", "--checkpoint", "/tmp", "--out", "/tmp/never"], "give the checkpoint once"),
    (["export", "--out", "/tmp/never"], "give a checkpoint"),
])
def test_bad_weights_input(args, message):
    r = invoke(*args)
    assert r.exit_code == 2 and message in r.output, r.output


def test_a_checkpoint_saved_without_a_config_says_so(imported, tmp_path):
    """Saved from Python with config_toml="": the default model was built and its shapes refused."""
    from shard.run.checkpoint import Checkpoints
    from shard.run.stored import read_params

    params, _, _ = read_params(imported)
    ckpts = Checkpoints(tmp_path / "ck")
    ckpts.save(3, {"params": params}, position=0, seed=0, config_toml="")
    ckpts.wait()
    ckpts.close()
    r = invoke("generate", "--checkpoint", tmp_path / "ck", "--prompt-ids", "1", "--max-new-tokens", 1)
    assert r.exit_code == 2 and f"checkpoint {tmp_path / 'ck'} holds no model config" in r.output, r.output


def test_shape_mismatch_names_the_parameter(imported, tmp_path):
    r = invoke("train", "--init-from", imported, "--set", "model.mlp_dim=64", "--mesh", "8x1", "--steps", 1,
               "--batch", 8, "--seq", 32, "--run-dir", tmp_path / "bad")
    assert r.exit_code == 2 and "parameter layers/w_down is (2, 128, 64) in the weights but (2, 64, 64)" in r.output, r.output


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "5,,7"], "--prompt-ids expects comma-separated integers"),
    (["--prompt-ids", "5,300"], "token id 300 is outside the model's vocabulary 0..255"),
    (["--prompt", "x", "--temperature", "nan"], "sampling needs temperature >= 0"),
])
def test_bad_generate_input(imported, args, message):
    r = invoke("generate", "--checkpoint", imported, "--max-new-tokens", 2, "--mesh", "8x1", *args)
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_an_empty_prompt_is_one_line_with_no_blank_line_before_it(imported):
    r = invoke("generate", "--checkpoint", imported, "--max-new-tokens", 2, "--mesh", "8x1", "--prompt", "")
    assert r.exit_code == 2 and r.output.startswith("error: the prompt is empty"), repr(r.output)


def test_an_error_while_generating_starts_its_own_line(imported, monkeypatch):
    """The prompt is printed first, without a newline; the out-of-memory error was appended to it."""
    from shard.training.generate import Generator

    def out_of_memory(self, prompt, *args, on_token=None, **kwargs):
        on_token(ord("!"))
        raise MemoryError()

    monkeypatch.setattr(Generator, "generate", out_of_memory)
    r = invoke("generate", "--checkpoint", imported, "--max-new-tokens", 2, "--mesh", "8x1", "--prompt", "Hi")
    assert r.exit_code == 2 and r.output.splitlines()[0] == "Hi!", r.output
    assert r.output.splitlines()[1].startswith("error: out of memory"), r.output


def test_a_prompts_file_has_one_prompt_per_newline(tmp_path):
    """str.splitlines also split at form feeds (common in Python source) and other separators."""
    from shard.cli.generate import _prompt_texts

    f = tmp_path / "p.txt"
    f.write_bytes(b"def f():\x0cpass\r\nx = 1\n")
    assert _prompt_texts(None, f) == ["def f():\x0cpass", "x = 1"]


@pytest.mark.parametrize("content, message", [
    (b"", "holds no prompt"), (b"\n  \n", "holds no prompt"), (b"\xff\xfe\x00", "is not UTF-8 text"),
])
def test_bad_prompts_file(imported, tmp_path, content, message):
    f = tmp_path / "prompts.txt"
    f.write_bytes(content)
    r = invoke("generate", "--checkpoint", imported, "--prompts-file", f, "--mesh", "8x1")
    assert r.exit_code == 2 and message in r.output, r.output


def test_damaged_hf_folders_and_moe_export_are_refused(hf_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((hf_dir / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes()[:1000])  # truncated
    r = invoke("import-hf", broken, "--out", tmp_path / "out")
    assert r.exit_code == 2 and "is not a readable safetensors file" in r.output, r.output
    (broken / "config.json").write_text("[1, 2]")
    r = invoke("generate", "--checkpoint", broken, "--prompt", "x")
    assert r.exit_code == 2 and "must hold a JSON object" in r.output, r.output
    assert not (tmp_path / "out").exists()
    # not a Hugging Face folder: said so (it was "no complete checkpoint in ...", about shard's own)
    (broken / "config.json").unlink()
    r = invoke("import-hf", broken, "--out", tmp_path / "out")
    assert r.exit_code == 2 and f"{broken} holds no config.json: give a Hugging Face Llama folder" in r.output
    (broken / "config.json").mkdir()
    r = invoke("import-hf", broken, "--out", tmp_path / "out")
    assert r.exit_code == 2 and "has a config.json that is not a file" in r.output, r.output
    r = invoke("generate", "--checkpoint", broken, "--prompt", "x")
    assert r.exit_code == 2 and f"{broken}/config.json is not a file" in r.output, r.output
    good = hf.read_hf_dir(str(hf_dir))
    cfg = hf.config_from_hf(good[0])
    for change, message in ((dict(num_hidden_layers=2.5), "num_hidden_layers must be a positive integer, got 2.5"),
                            (dict(num_hidden_layers=True), "num_hidden_layers must be a positive integer"),
                            (dict(rms_norm_eps=-1), "rms_norm_eps must be a positive number"),
                            (dict(num_key_value_heads=3), "must be a multiple of model.n_kv_heads")):
        with pytest.raises(ShardError, match=message):
            hf.config_from_hf(good[0] | change)
    for name, tensor, message in (("model.layers.2.mlp.up_proj.weight", np.zeros((2, 2), np.float32),
                                   "holds tensor model.layers.2.mlp.up_proj.weight, which the config does not"),
                                  ("model.norm.weight", np.full(64, np.nan, np.float32), "holds NaN"),
                                  ("model.norm.weight", np.ones(64, np.int8), "float weights only")):
        with pytest.raises(ShardError, match=message):
            hf.params_from_hf(dict(good[1]) | {name: tensor}, cfg)
    import ml_dtypes

    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in good[1].items()}  # how most HF Llamas are published
    np.testing.assert_array_equal(hf.params_from_hf(bf16, cfg)["embed"], good[1]["model.embed_tokens.weight"]
                                  .astype(ml_dtypes.bfloat16).astype(np.float32))
    moe = dataclasses.replace(PRESETS["moe-fine-tiny"])  # a router Mixtral's folders can't hold (moe-tiny's they can)
    with pytest.raises(ShardError, match="Mixtral's router is a softmax renormalised"):
        hf.write_hf_dir(str(tmp_path / "moe"), moe, {})
    assert not (tmp_path / "moe").exists()  # refused before anything is written


def test_a_model_without_a_tokenizer_samples_only_ids(tmp_path):
    """--prompt-ids without --ids printed each new token as a byte: a traceback past id 255."""
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=512, name="tiny-512")
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(models.build(cfg, seed=1))))
    hf.write_hf_dir(str(tmp_path / "hf"), cfg, params)
    r = invoke("generate", "--checkpoint", tmp_path / "hf", "--prompt-ids", "1,2", "--max-new-tokens", 2,
               "--mesh", "8x1")
    assert r.exit_code == 2 and "512-token vocabulary" in r.output and "--ids" in r.output, r.output
    r = invoke("generate", "--checkpoint", tmp_path / "hf", "--prompt-ids", "1,2", "--ids", "--max-new-tokens", 2,
               "--mesh", "8x1")
    assert r.exit_code == 0 and len(r.output.split()) == 2, r.output


def test_a_write_that_fails_leaves_nothing_behind_and_the_files_are_readable(imported, hf_dir, tmp_path,
                                                                             monkeypatch):
    """On a full disk export-hf gave a traceback (safetensors' error is not an OSError) and import-hf
    left a half-written folder that the same command then refused; export-hf's weights were owner-only."""
    import errno
    import os
    import stat

    import safetensors.numpy

    from shard.run.checkpoint import Checkpoints

    r = invoke("export-hf", imported, "--out", tmp_path / "a" / "hf")
    assert r.exit_code == 0, r.output
    umask = os.umask(0)
    os.umask(umask)
    for f in (tmp_path / "a" / "hf").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f
    assert stat.S_IMODE((tmp_path / "a" / "hf").stat().st_mode) == 0o777 & ~umask

    def full(*args, **kwargs):
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    r = invoke("export-hf", imported, "--out", tmp_path / "b" / "hf")
    assert r.exit_code == 2 and "No space left on device (os error 28)" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "b").exists()
    (tmp_path / "mounted").mkdir()  # an empty folder given (a mount point): written in place, emptied again
    r = invoke("export-hf", imported, "--out", tmp_path / "mounted")
    assert r.exit_code == 2 and list((tmp_path / "mounted").iterdir()) == [], r.output

    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "ocdbt.process_0")

    monkeypatch.setattr(Checkpoints, "save", no_space)
    r = invoke("import-hf", hf_dir, "--out", tmp_path / "c" / "run")
    assert r.exit_code == 2 and "No space left on device" in r.output, r.output
    assert not (tmp_path / "c").exists()


def test_generate_takes_the_rules_a_model_needs_on_a_mesh(imported):
    """Its 4 KV heads don't split 8 ways: the error said to change the rule, and generate had no way to."""
    r = invoke("generate", "--checkpoint", imported, "--prompt", "ab", "--max-new-tokens", 2, "--mesh", "1x8")
    assert r.exit_code == 2 and "--set rules.kv_heads=none" in r.output, r.output
    r = invoke("generate", "--checkpoint", imported, "--prompt-ids", "1,2", "--ids", "--max-new-tokens", 2,
               "--temperature", 0, "--mesh", "1x8", "--set", "rules.kv_heads=none")
    greedy = invoke("generate", "--checkpoint", imported, "--prompt-ids", "1,2", "--ids", "--max-new-tokens", 2,
                    "--temperature", 0, "--mesh", "8x1")
    assert r.exit_code == 0 and r.output.split() == greedy.output.split(), r.output + greedy.output
    r = invoke("generate", "--checkpoint", imported, "--prompt", "ab", "--mesh", "8x1", "--set", "optimizer.lr=1")
    assert r.exit_code == 2 and "generate takes rules.*" in r.output, r.output


def test_token_ids_context_length_and_tokenizer_survive_import_fine_tune_and_export(hf_dir, tmp_path):
    """export-hf wrote shard's config alone: no bos/eos ids (transformers then never stopped at the end
    of sequence), a context length of 4096 whatever the model's, no generation or tokenizer files."""
    source = tmp_path / "source"
    shutil.copytree(hf_dir, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"bos_token_id": 1, "eos_token_id": 2,
                                                             "max_position_embeddings": 131072}))
    (source / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    (source / "tokenizer_config.json").write_text('{"model_max_length": 131072}')
    assert invoke("import-hf", source, "--out", tmp_path / "imp").exit_code == 0
    r = invoke("train", "--init-from", tmp_path / "imp", "--mesh", "8x1", "--steps", 1, "--batch", 8, "--seq", 32,
               "--run-dir", tmp_path / "tuned")
    assert r.exit_code == 0, r.output
    r = invoke("export-hf", tmp_path / "tuned", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"], exported["max_position_embeddings"]) == (1, 2, 131072)
    assert exported["num_key_value_heads"] == config["num_key_value_heads"]  # shard's own keys stay shard's
    for name in ("generation_config.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_text() == (source / name).read_text()


def test_a_checkpoint_whose_saved_config_is_not_toml_is_one_line(imported, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(imported, broken)
    meta_file = broken / "checkpoints" / "0" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "config": "[model\n"}))
    r = invoke("generate", broken, "--prompt", "x", "--max-new-tokens", 2, "--mesh", "8x1")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert f"the config saved with checkpoint {broken} is not valid TOML" in r.output


@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_checkpoint_without_its_array_metadata_is_one_line(imported, tmp_path, command):
    """orbax reads a missing state/_METADATA as None: a TypeError traceback."""
    broken = tmp_path / "broken"
    shutil.copytree(imported, broken)
    (broken / "checkpoints" / "0" / "state" / "_METADATA").unlink()
    args = ["--prompt", "x", "--max-new-tokens", 2, "--mesh", "8x1"] if command == "generate" else ["--out", tmp_path / "o"]
    r = invoke(command, broken, *args)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "holds no description of its arrays" in r.output


def test_init_from_is_saved_in_the_config_and_a_resume_prefers_its_own_checkpoint(imported, tmp_path):
    """--init-from was recorded nowhere: a run started from a fine-tune's config.toml began from random
    weights. And --init-from with --resume was refused, so a preemptible fine-tune needed two commands."""

    run, source = tmp_path / "ft", tmp_path / "source"
    shutil.copytree(imported, source)

    def fine_tune(steps, weights=source):  # one command for every start of a preemptible job
        return invoke("train", "--init-from", weights, "--resume", "--allow-fresh", "--mesh", "8x1", "--steps",
                      steps, "--batch", 8, "--seq", 32, "--run-dir", run, "--compile-cache", "none")

    first = fine_tune(2)
    assert first.exit_code == 0, first.output
    assert f"initialised from {source}" in first.output and "no checkpoint in" in first.output
    assert "not an exact resume" not in first.output  # a first start: nothing saved to differ from
    saved = config.resolve(config.load_file(str(run / "config.toml")))
    assert saved.init_from == str(source) and saved.model.n_kv_heads == 4 and (run / "hf").is_dir()
    other = invoke("train", "--config", run / "config.toml", "--run-dir", tmp_path / "again", "--steps", 1)
    assert other.exit_code == 0 and f"initialised from {source}" in other.output, other.output
    # the weights are gone and config.toml is lost: the run resumes from its checkpoint and its saved config
    # (it read the weights' Hugging Face side files again, from a folder no longer there)
    shutil.rmtree(source)
    (run / "config.toml").unlink()
    again = fine_tune(3)
    assert again.exit_code == 0 and "resumed from step 2" in again.output and "initialised" not in again.output
    moved = fine_tune(4, imported)  # other weights named at a resume: not read, and not put on record
    assert moved.exit_code == 0 and f"init_from {imported} is not read: the run resumes from its own" in moved.output
    assert config.resolve(config.load_file(str(run / "config.toml"))).init_from == str(source)


def test_init_from_in_a_config_file_builds_the_weights_model(imported, tmp_path):
    """Only the flag read the weights' model: a config file naming init_from built the default model,
    and loading the weights failed on the first shape."""
    (tmp_path / "ft.toml").write_text(f'init_from = "{imported}"\nsteps = 1\n[data]\nbatch = 8\nseq_len = 32\n')
    r = invoke("train", "--config", tmp_path / "ft.toml", "--mesh", "8x1", "--run-dir", tmp_path / "r",
               "--compile-cache", "none")
    assert r.exit_code == 0 and f"initialised from {imported}" in r.output, r.output


def test_an_export_over_the_file_limit_is_split_with_an_index_that_transformers_can_follow(hf_dir, tmp_path,
                                                                                            monkeypatch):
    """Every export above 4 GiB (a 1B model in float32) goes through the index: each weight_map entry
    must name the file that holds the tensor."""
    monkeypatch.setattr(hf, "_FILE_LIMIT", 64 << 10)
    config_json, tensors = hf.read_hf_dir(str(hf_dir))
    cfg = hf.config_from_hf(config_json)
    files = hf.write_hf_dir(str(tmp_path / "out"), cfg, hf.params_from_hf(tensors, cfg))
    assert len(files) > 2 and all(f.stat().st_size <= (64 << 10) + (1 << 20) for f in files)
    weight_map = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map) == set(tensors)
    for name, file in weight_map.items():
        np.testing.assert_array_equal(load_file(str(tmp_path / "out" / file))[name], tensors[name])


@pytest.mark.parametrize("config_json, theta", [
    ({"rope_theta": 500000.0}, 500000.0),  # transformers < 5
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e6),  # transformers >= 5
    ({}, 10000.0),
])
def test_rope_theta_is_read_from_either_form_of_config_json(config_json, theta):
    """A Llama 3 (theta 500000) imported with 10000 computes other logits, silently."""
    base = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 8, "intermediate_size": 128}
    assert hf.config_from_hf(base | config_json).rope_theta == theta


def test_a_plain_rope_export_does_not_take_the_originals_rope_scaling(hf_dir, tmp_path):
    """The side files' config.json lends its keys that shard's doesn't set: a Llama 3.1 original's llama3
    rope_scaling made a plain-RoPE export scaled (transformers reads rope_scaling first)."""
    side = tmp_path / "side"
    side.mkdir()
    original = json.loads((hf_dir / "config.json").read_text())
    (side / "config.json").write_text(json.dumps(original | {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}))
    config_json, tensors = hf.read_hf_dir(str(hf_dir))
    cfg = hf.config_from_hf(config_json)
    hf.write_hf_dir(str(tmp_path / "out"), cfg, hf.params_from_hf(tensors, cfg), side=side)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "rope_scaling" not in written and hf.config_from_hf(written).rope_scaling == 0.0
    # and where both keys are given, rope_scaling is read first, as transformers does
    both = written | {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      "rope_scaling": {"rope_type": "default"}}
    assert hf.config_from_hf(both).rope_scaling == 0.0


@pytest.mark.parametrize("d_model, ways", [(64, {"fsdp": 8}), (68, {"fsdp": 4}), (66, {"fsdp": 2}),
                                           (67, {"data": 1, "model": 1})])
def test_an_import_writes_through_fsdp_over_the_cpu_devices_where_the_dims_divide(d_model, ways):
    """import-hf spreads the weights over 8 simulated devices (or 4, 2 where a dim does not divide) so
    orbax writes, and a restore decodes, one shard of a layer stack at a time."""
    from shard.run.hf_convert import import_spec
    from shard.config.presets import PRESETS
    from shard.testing import tiny_config

    tcfg = tiny_config("1x1")
    tcfg = dataclasses.replace(tcfg, model=dataclasses.replace(PRESETS["tiny"], d_model=d_model))
    spec = import_spec(tcfg, jax.devices())
    assert {dict(s.mesh.shape) == ways for s in jax.tree.leaves(spec.shardings["params"])} == {True}
