"""LoRA: adapters sharded by their base weights' rules on every layout, the base frozen and out of the
optimizer, checkpoints of the adapters alone restored onto their base, and exports that transformers
and peft read back to the same logits."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from shard import config as config_mod
from shard.errors import ShardError
from shard.paths import CHECKPOINTS_DIR
from shard.run.checkpoint import Checkpoints, SaveCheckpoints
from shard.testing import devices_for, tiny_config
from shard.training.loop import train
from shard.training.prepare import prepare

LORA = dict(lora__rank=4, lora__alpha=8.0, lora__dropout=0.1, lora__targets=["wq", "wv", "wo", "w_up", "w_down"],
            optimizer__lr=2e-2, optimizer__warmup_steps=0)


def lora_run(mesh: str, **sets):
    cfg = tiny_config(mesh, **(LORA | sets))
    run = prepare(cfg, devices_for(mesh))
    before = jax.device_get(run.state["params"])
    records = train(cfg, run=run)
    return cfg, records, before, run


@pytest.fixture(scope="module")
def reference():
    return lora_run("1x1")


def test_only_the_adapters_train_and_the_optimizer_holds_them_alone(reference):
    cfg, records, before, run = reference
    after = jax.device_get(run.state["params"])
    layers = after["layers"]
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "attn_norm"):
        np.testing.assert_array_equal(layers[name], before["layers"][name], err_msg=name)
    np.testing.assert_array_equal(after["embed"], before["embed"])
    assert np.abs(layers["wq_lora_b"]).max() > 0  # B started at zero and trained
    assert not np.array_equal(layers["wq_lora_a"], before["layers"]["wq_lora_a"])
    opt_names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(run.state["opt_state"])[0]}
    assert opt_names and all("_lora_" in n for n in opt_names if "layers" in n)
    assert not any("'embed'" in n for n in opt_names)
    assert len({round(r["loss"], 6) for r in records}) == 3


@pytest.mark.parametrize("mesh", ["fsdp", "2x4", "sp"])
def test_losses_and_grad_norms_match_single_device(mesh, reference):
    """The adapters name their base weights' logical axes: FSDP shards them on embed, tensor parallel on
    heads and mlp, and the losses and gradient norms are one device's, with sequence and context
    parallelism too (the dropout masks are drawn per layer from the step, whatever the layout)."""
    _, ref_records, _, _ = reference
    _, records, _, run = lora_run(mesh)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in ref_records], rtol=1e-5, err_msg=key)
    specs = run.spec.shardings["params"]["layers"]
    if mesh == "2x4":  # model=4: B of wq split over heads like wq; A of wo over heads like wo's input
        assert specs["wq_lora_b"].spec[2] == "model" and specs["wo_lora_a"].spec[1] == "model"
        assert specs["wq_lora_a"].spec[2] is None  # lora_rank: replicated
    elif mesh == "fsdp":  # embed, the input of wq's A and the output of wo's B
        assert specs["wq_lora_a"].spec[1] == "fsdp" and specs["wo_lora_b"].spec[2] == "fsdp"


@pytest.mark.parametrize("mesh", ["cp", "stage=2,data=4"])
def test_context_and_pipeline_parallel_lora_match_single_device(mesh):
    """Under context parallelism the sequence runs in ring attention's zig-zag order, and pipeline stages
    draw dropout masks per stage, so dropout would draw other masks (the same distribution, not the
    same draw): without dropout the losses and gradient norms are one device's."""
    ref = lora_run("1x1", lora__dropout=0.0, data__batch=16)[1]
    records = lora_run(mesh, lora__dropout=0.0, data__batch=16)[1]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in ref], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("sets, message", [
    (dict(lora__rank=4, lora__targets=["w_q"]), "'w_q' names no weight LoRA adapts"),
    (dict(lora__rank=-1), "lora.rank must be 0 (off) or a positive rank"),
    (dict(lora__rank=4, lora__dropout=1.0), "lora.dropout must be in [0, 1)"),
    (dict(lora__rank=4, lora__targets=[]), "lora.targets names no weight"),
    (dict(lora__rank=4, lora__targets=["w_up"], model__name="moe-tiny"), "is an expert weight"),
    # a rank past the weight's smaller side was accepted (100000 on a 64-wide model)
    (dict(lora__rank=100000, lora__targets=["wq"]), "lora.rank 100000 is above what wq (64 -> 64 in tiny) can use: "
                                                    "at most 64"),
    (dict(lora__rank=0, lora__targets=[]), "lora.targets is empty but lora.rank is 0, which turns LoRA off"),
    (dict(lora__targets=["wo"]), "lora.targets is wo but lora.rank is 0"),
])
def test_bad_lora_settings_are_one_line(sets, message):
    with pytest.raises(ShardError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        tiny_config("1x1", **sets)


# --- checkpoints and exports ------------------------------------------------------------------------------


def _hf_base(tmp_path):
    """A tiny Hugging Face folder to fine-tune from."""
    from flax import nnx

    from shard import models
    from shard.run import hf

    model = config_mod.PRESETS["tiny"]
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(models.build(model, seed=3))))
    hf.write_hf_dir(str(tmp_path / "base"), model, params)
    return tmp_path / "base"


def _saved_lora_run(run_dir, cfg, restore=None):
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir),
                              checkpoint=dataclasses.replace(cfg.checkpoint, every=2, keep=10))
    toml = config_mod.to_toml(cfg)
    ckpts = Checkpoints(run_dir / CHECKPOINTS_DIR, cfg.checkpoint)
    run = prepare(cfg, devices_for(cfg.mesh.spec), restore=restore(ckpts) if restore else None)
    records = train(cfg, run=run, observers=[SaveCheckpoints(ckpts, seed=cfg.seed, config_toml=toml)])
    ckpts.close()
    return records, run


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """4 LoRA steps from a Hugging Face folder, saved at steps 2 and 4."""
    from shard.run import weights

    tmp = tmp_path_factory.mktemp("lora")
    base = _hf_base(tmp)
    cfg = tiny_config("1x1", **LORA, steps=4, init_from=str(base))
    loaded = weights.load(base)[1]
    records, run = _saved_lora_run(tmp / "run", cfg, lambda c: lambda spec: weights.state_from(loaded, spec, 0, str(base)))
    return cfg, tmp, records, run


def test_checkpoints_hold_the_adapters_and_resume_onto_their_base_exactly(fine_tuned):
    cfg, tmp, records, run = fine_tuned
    ckpts = Checkpoints(tmp / "run" / CHECKPOINTS_DIR, read_only=True)
    stored = ckpts.stored_tree(4)
    ckpts.close()
    assert set(stored["params"]) == {"layers"} and all("_lora_" in k for k in stored["params"]["layers"])
    meta = json.loads((tmp / "run" / CHECKPOINTS_DIR / "4" / "meta" / "metadata").read_text())
    assert "layers/wq" in meta["lora_base_fingerprint"] and str(tmp / "base") in meta["config"]
    # resume from step 2 (step 4's checkpoint moved away): steps 3 and 4 again, bit for bit
    shutil.move(tmp / "run" / CHECKPOINTS_DIR / "4", tmp / "step4")
    try:
        again, resumed = _saved_lora_run(tmp / "run", cfg, lambda c: c.restore_latest)
        assert resumed.start_step == 2
        assert [r["loss"] for r in again] == [r["loss"] for r in records[2:]]
    finally:
        shutil.rmtree(tmp / "run" / CHECKPOINTS_DIR / "4", ignore_errors=True)
        shutil.move(tmp / "step4", tmp / "run" / CHECKPOINTS_DIR / "4")


def _shard_logits(run, tokens):
    from shard.models import llama
    from shard.models.lora import adapting

    params = jax.device_get(run.state["params"])
    with adapting(run.spec.lora):
        return np.asarray(llama.forward(run.cfg.model, params, tokens)[0])[..., :run.cfg.model.vocab_size]


def test_peft_and_merged_exports_give_shards_logits(fine_tuned, tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers
    from typer.testing import CliRunner

    from shard.cli.app import app

    cfg, tmp, _, run = fine_tuned
    ckpt = tmp / "run"
    result = CliRunner().invoke(app, ["export-hf", str(ckpt), "--lora-out", str(tmp_path / "peft"), "--merge",
                                      "--out", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 16)).astype(np.int32)
    want = _shard_logits(run, tokens)
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp / "base", dtype=torch.float32)
        base_logits = base(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "peft")
        got = peft_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        got_merged = merged(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        # the adapter names its base, so peft finds it alone
        auto = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "peft", dtype=torch.float32)
        got_auto = auto(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_merged, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_auto, want, rtol=1e-4, atol=1e-4)
    # the adapters moved the logits: the test compares something LoRA changed
    assert np.abs(base_logits - want).max() > 1e-3


def test_a_peft_adapter_over_an_imported_model_names_the_folder_it_came_from(fine_tuned, tmp_path):
    """Fine-tuned over `shard import-hf`'s run dir, the adapter named that run dir as its base, which peft
    cannot load: it names the Hugging Face folder the import read (the run's init_from, rewritten here)."""
    from typer.testing import CliRunner

    from shard.cli.app import app

    _, tmp, _, _ = fine_tuned
    assert CliRunner().invoke(app, ["import-hf", str(tmp / "base"), "--out", str(tmp_path / "imp")]).exit_code == 0
    meta = tmp / "run" / CHECKPOINTS_DIR / "4" / "meta" / "metadata"
    text = meta.read_text()
    try:
        meta.write_text(text.replace(str(tmp / "base"), str(tmp_path / "imp")))
        result = CliRunner().invoke(app, ["export-hf", str(tmp / "run"), "--lora-out", str(tmp_path / "peft")])
    finally:
        meta.write_text(text)
    assert result.exit_code == 0, result.output
    adapter = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((tmp / "base").absolute()), adapter
    assert f"over {(tmp / 'base').absolute()}" in result.output


def test_a_lora_checkpoint_is_refused_as_a_whole_model_and_its_base_is_checked(fine_tuned, tmp_path):
    from typer.testing import CliRunner

    from shard.cli.app import app
    from shard.run import weights

    _, tmp, _, _ = fine_tuned
    result = CliRunner().invoke(app, ["export-hf", str(tmp / "run"), "--out", str(tmp_path / "plain")])
    assert result.exit_code == 2 and "--merge" in result.output
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.training.state import state_spec

    plain = tiny_config("1x1")
    spec = state_spec(plain.model, plain.optimizer, plain.steps, make_layout(plain, parse_mesh("1x1"), devices_for("1x1")))
    ckpts = Checkpoints(tmp / "run" / CHECKPOINTS_DIR, read_only=True)
    try:
        with pytest.raises(ShardError, match="holds LoRA adapters, not a whole model"):
            ckpts.restore_latest(spec)
    finally:
        ckpts.close()
    changed = tmp_path / "base"
    shutil.copytree(tmp / "base", changed)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(changed / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"] += 1e-3
    save_file(tensors, changed / "model.safetensors")
    meta_cfg = tmp / "run" / CHECKPOINTS_DIR / "4" / "meta" / "metadata"
    text = meta_cfg.read_text()
    try:
        meta_cfg.write_text(text.replace(str(tmp / "base"), str(changed)))
        with pytest.raises(ShardError, match="are not those its adapters were trained on"):
            weights.load(tmp / "run")
        ckpts = Checkpoints(tmp / "run" / CHECKPOINTS_DIR, read_only=True)
        try:  # a resume reads the base through the checkpoints, not weights.load: checked there too
            with pytest.raises(ShardError, match=f"checkpoint {ckpts.path(4)} \\({changed}\\) are not those its "
                                                 "adapters were trained on"):
                ckpts.restore_latest(fine_tuned[3].spec)
        finally:
            ckpts.close()
    finally:
        meta_cfg.write_text(text)
