"""Training on real data: a trained BPE tokenizer over JSON Lines, the model's vocabulary following it,
the data cache, packed rows, a mixture resumed on another mesh, and the tokenizer travelling with the
run to generate, export-hf and import-hf."""

import dataclasses
import json
import shutil
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

from shard import config as config_mod
from shard.cli.app import app
from shard.data.batches import training_samples
from shard.data.store import prepare_store
from shard.data.tokenizers import load_tokenizer, train_bpe
from shard.observe.metrics import read_jsonl
from shard.paths import CHECKPOINTS_DIR
from shard.run.checkpoint import Checkpoints, SaveCheckpoints
from shard.testing import devices_for, tiny_config
from shard.training.loop import train
from shard.training.prepare import prepare

TINY = ["--model", "tiny", "--steps", "3", "--batch", "8", "--seq", "32", "--mesh", "8x1", "--log-every", "1"]


def invoke(*args):
    return CliRunner().invoke(app, list(args))


def _paragraphs(limit: int) -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:12]
    paras = [p for f in files for p in f.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    return paras[:limit]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder with docs.jsonl (short documents), code.jsonl (others), a 300-id BPE tokenizer trained on
    them, and a store of each."""
    root = tmp_path_factory.mktemp("corpus")
    paras = _paragraphs(900)
    for name, part in (("docs", paras[:600]), ("code", paras[600:])):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": p}) + "\n" for p in part)
    tok = train_bpe(iter(paras), 300, root / "tok")
    for name in ("docs", "code"):
        prepare_store([str(root / f"{name}.jsonl")], tok, root / f"{name}-store", workers=1, progress=False)
    return root


def test_vocab_follows_the_tokenizer_and_the_run_keeps_it(corpus, tmp_path):
    run = tmp_path / "run"
    cache = tmp_path / "cache"
    args = [*TINY, "--data", str(corpus / "docs.jsonl"), "--tokenizer", str(corpus / "tok"), "--packing", "packed",
            "--set", f"data.cache={cache}"]
    result = invoke("train", *args, "--run-dir", str(run))
    assert result.exit_code == 0, result.output
    assert "model.vocab_size 384: the tokenizer's 300 ids, padded up to a multiple of 128" in result.output
    assert "packed rows" in result.output and "tokenizer huggingface (300 ids, eos 0)" in result.output
    assert "· 1 file, 600 documents, " in result.output  # what --data read
    saved = config_mod.resolve(config_mod.load_file(str(run / "config.toml")))
    assert saved.model.vocab_size == 384 and saved.data.packing == "packed"
    assert load_tokenizer(str(run / "tokenizer")).fingerprint == load_tokenizer(str(corpus / "tok")).fingerprint
    records = read_jsonl(run / "metrics.jsonl")
    assert all(0.5 < r["packing"] <= 1 for r in records)
    # tokens seen count real tokens: the packed share of each step's 8 x 32 positions
    seen = np.cumsum([r["packing"] * 8 * 32 for r in records])
    np.testing.assert_allclose([r["tokens_seen"] for r in records], seen)
    # the raw source was prepared into the cache once; a second run reads it again, unprepared
    (stored,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    made = (stored / "store.json").stat().st_mtime_ns
    again = invoke("train", *args, "--run-dir", str(tmp_path / "again"))
    assert again.exit_code == 0, again.output
    assert [p for p in cache.iterdir() if not p.name.startswith(".")] == [stored]
    assert (stored / "store.json").stat().st_mtime_ns == made
    # the run's tokenizer goes to generate and export-hf without being named
    gen = invoke("generate", str(run), "--prompt", "def main(", "--max-new-tokens", "4", "--temperature", "0",
                 "--mesh", "8x1")
    assert gen.exit_code == 0, gen.output
    assert gen.output.startswith("def main(")
    scored = invoke("eval", str(run), "--data", str(corpus / "code.jsonl"), "--batches", "1", "--json",
                    "--mesh", "8x1")
    assert scored.exit_code == 0, scored.output
    assert json.loads(scored.output.splitlines()[-1])["tokens"] > 0
    out = tmp_path / "hf"
    exported = invoke("export-hf", str(run), "--out", str(out))
    assert exported.exit_code == 0 and "and the run's tokenizer" in exported.output, exported.output
    from transformers import AutoTokenizer

    hf_ids = AutoTokenizer.from_pretrained(out)("def main(x):")["input_ids"]
    assert hf_ids == load_tokenizer(str(corpus / "tok")).encode_batch(["def main(x):"])[0].tolist()
    # import-hf brings the folder's tokenizer along: generate finds it there
    imported = tmp_path / "imported"
    assert invoke("import-hf", str(out), "--out", str(imported)).exit_code == 0
    gen2 = invoke("generate", str(imported), "--prompt", "def main(", "--max-new-tokens", "4", "--temperature", "0",
                 "--mesh", "8x1")
    assert gen2.exit_code == 0 and gen2.output == gen.output, (gen.output, gen2.output)


@pytest.mark.parametrize("extra, message", [
    (["--set", "model.vocab_size=256"], "has 300 ids, more than model.vocab_size 256 (set by"),
    (["--tokenizer", "byte"], "was made with the huggingface tokenizer"),
])
def test_a_tokenizer_that_does_not_fit_is_one_line(corpus, tmp_path, extra, message):
    result = invoke("train", *TINY, "--data", str(corpus / "docs-store"), *extra, "--run-dir", str(tmp_path / "r"))
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_a_store_names_its_own_tokenizer(corpus):
    cfg = tiny_config("8x1", data__path=str(corpus / "docs-store"))
    from shard.data.corpus import fit_vocab

    fitted, note = fit_vocab(cfg, vocab_set=False)
    assert fitted.model.vocab_size == 384 and "300 ids" in note


def _checkpointed(run_dir: Path, cfg, restore_step: int | None = None):
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir),
                              checkpoint=dataclasses.replace(cfg.checkpoint, every=2, keep=10))
    run_dir.mkdir(parents=True, exist_ok=True)
    toml = config_mod.to_toml(cfg)
    ckpts = Checkpoints(run_dir / CHECKPOINTS_DIR, cfg.checkpoint)
    restore = None if restore_step is None else (lambda spec: ckpts.restore(restore_step, spec))
    try:
        run = prepare(cfg, devices_for(cfg.mesh.spec), restore=restore)
        records = train(cfg, run=run, observers=[SaveCheckpoints(ckpts, seed=cfg.seed, config_toml=toml)])
    finally:
        ckpts.close()
    return [r["loss"] for r in records], run


def test_a_packed_mixture_resumes_on_another_mesh_with_the_same_rows(corpus, tmp_path):
    mix = tmp_path / "mix.toml"
    mix.write_text(f'[[sources]]\npath = "{corpus / "docs-store"}"\nweight = 3\n'
                   f'[[sources]]\npath = "{corpus / "code-store"}"\nweight = 1\nepochs = 50\n')
    cfg = tiny_config("2x4", steps=8, data__path=str(mix), data__packing="packed", model__vocab_size=384)
    losses, _ = _checkpointed(tmp_path / "ref", cfg)
    # the stream is a pure function of the sample index: another mesh reads the same rows
    a, b = training_samples(cfg), training_samples(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, spec="8x1")))
    rows_a, rows_b = a.rows(32, 64), b.rows(32, 64)
    assert all(np.array_equal(rows_a[k], rows_b[k]) for k in rows_a)
    run_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ref", run_dir, ignore=shutil.ignore_patterns("[6-9]"))
    other = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, spec="8x1"))
    resumed, run = _checkpointed(run_dir, other, restore_step=4)
    assert run.start_step == 4
    np.testing.assert_allclose(resumed, losses[4:], rtol=1e-5)
    jax.clear_caches()


def test_a_mixture_capped_below_the_run_is_refused_before_compiling(tmp_path):
    (tmp_path / "a.txt").write_text("abc" * 300)
    mix = tmp_path / "mix.toml"
    mix.write_text('[[sources]]\npath = "a.txt"\nweight = 1\nepochs = 1\n')
    cfg = tiny_config("8x1", steps=400, data__path=str(mix))
    from shard.errors import ShardError

    with pytest.raises(ShardError, match=r"holds 1,024 samples \(its sources' epochs caps\), fewer than the 3,200"):
        prepare(cfg, devices_for("8x1"))


def test_every_source_of_a_mixture_is_read_with_the_runs_tokenizer(corpus, tmp_path):
    from shard.data.store import TokenStore

    mix = tmp_path / "mix.toml"
    mix.write_text(f'[[sources]]\npath = "{corpus / "docs-store"}"\nweight = 1\n'
                   f'[[sources]]\npath = "{corpus / "code.jsonl"}"\nweight = 1\n')
    cfg = tiny_config("8x1", data__path=str(mix), model__vocab_size=384, data__cache=str(tmp_path / "cache"))
    training_samples(cfg)  # the JSONL is prepared with the store's tokenizer, not read as bytes
    (made,) = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    assert TokenStore.open(made).tokenizer().fingerprint == load_tokenizer(str(corpus / "tok")).fingerprint
    other = train_bpe(iter(_paragraphs(200)), 280, tmp_path / "other")
    prepare_store([str(corpus / "code.jsonl")], other, tmp_path / "other-store", workers=1, progress=False)
    mix.write_text(f'[[sources]]\npath = "{corpus / "docs-store"}"\nweight = 1\n'
                   f'[[sources]]\npath = "{tmp_path / "other-store"}"\nweight = 1\n')
    from shard.errors import ShardError

    with pytest.raises(ShardError, match="source 2: token store .* was made with the huggingface tokenizer"):
        training_samples(cfg)


def test_a_resume_with_another_tokenizer_is_refused(corpus, tmp_path):
    run = tmp_path / "run"
    args = [*TINY, "--data", str(corpus / "docs.jsonl"), "--set", f"data.cache={tmp_path / 'cache'}"]
    assert invoke("train", *args, "--tokenizer", str(corpus / "tok"), "--run-dir", str(run)).exit_code == 0
    train_bpe(iter(_paragraphs(200)), 280, tmp_path / "other")
    result = invoke("train", *args, "--tokenizer", str(tmp_path / "other"), "--run-dir", str(run), "--resume",
                    "--steps", "4")
    assert result.exit_code == 2, result.output
    assert "trained with the huggingface tokenizer" in result.output and "give --tokenizer" in result.output
