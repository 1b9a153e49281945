"""lm-evaluation-harness on the mesh: shard's backend agrees with lm-eval's own Hugging Face backend
(`hf`, PyTorch on CPU) on a tiny model exported as a Hugging Face folder, for a multiple-choice task
read from a local task YAML over a JSONL file: the same accuracy and the same loglikelihoods, on one
device and on a sharded mesh. Offline: the task's data is a file the test writes."""

import dataclasses
import json
import os

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from shard.errors import ShardError  # noqa: E402
from shard.testing import devices_for, multiple_choice_task, tiny_config  # noqa: E402

QUESTIONS = [("The sky is", [" blue", " green", " loud"], 0), ("Two plus two is", [" four", " five"], 0),
             ("Cats like to", [" sleep", " swim", " fly", " bark"], 0), ("Water is", [" wet", " dry"], 1)]
TEXT = " ".join(q + c for q, cs, _ in QUESTIONS for c in cs) + " The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A random-init tiny model with a byte-level BPE, written as export-hf writes a Hugging Face folder,
    and a multiple-choice task YAML over a JSONL file beside it."""
    from flax import nnx

    from shard import models
    from shard.config.presets import PRESETS
    from shard.data.tokenizers import train_bpe
    from shard.run import hf

    root = tmp_path_factory.mktemp("harness")
    folder = root / "hf"
    tok = train_bpe([TEXT] * 4, 300, folder)
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=tok.vocab_size, compute_dtype="float32")
    params = nnx.to_pure_dict(nnx.state(models.build(cfg, seed=1)))
    hf.write_hf_dir(str(folder), cfg, params)
    task = multiple_choice_task(root, "tiny_mc", [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS])
    return folder, task


def _evaluate(lm, task):
    from shard.training.harness import task_specs

    manager, specs = task_specs([str(task)])
    out = lm_eval.simple_evaluate(model=lm, tasks=specs, task_manager=manager, log_samples=True,
                                  bootstrap_iters=0)
    logliks = [float(r[0]) for s in out["samples"]["tiny_mc"] for r in s["filtered_resps"]]
    return out["results"]["tiny_mc"]["acc,none"], logliks


@pytest.fixture(scope="module")
def reference(exported):
    from lm_eval.models.huggingface import HFLM

    folder, task = exported
    hf_lm = HFLM(pretrained=str(folder), device="cpu", batch_size=4, dtype="float32")
    return hf_lm, _evaluate(hf_lm, task)


def _shard_lm(folder, mesh: str, batch: int):
    from shard.run.harness import harness_lm
    from shard.sharding.mesh import parse_mesh

    return harness_lm(folder, tiny_config(mesh), parse_mesh(mesh), devices_for(mesh), batch)


@pytest.mark.parametrize("mesh", ["1x1", "fsdp=2,model=2"])
def test_agrees_with_lm_eval_hf_backend(exported, reference, mesh):
    folder, task = exported
    acc, logliks = _evaluate(_shard_lm(folder, mesh, batch=4), task)
    ref_acc, ref_logliks = reference[1]
    assert len(logliks) == sum(len(c) for _, c, _ in QUESTIONS)
    assert acc == ref_acc
    np.testing.assert_allclose(logliks, ref_logliks, rtol=1e-4)


def test_rolling_loglikelihood_and_greedy_generation_agree_and_scores_are_named(exported, reference):
    from lm_eval.api.instance import Instance

    from shard.training.harness import scores

    folder, _ = exported
    lm = _shard_lm(folder, "1x1", batch=4)
    requests = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate([TEXT, "Water is wet."])]
    np.testing.assert_allclose(lm.loglikelihood_rolling(requests), reference[0].loglikelihood_rolling(requests),
                               rtol=1e-4)
    generate = [Instance("generate_until", {}, ("The sky is", {"until": ["."], "max_gen_toks": 6}), 0)]
    text = lm.generate_until(generate)
    assert text == reference[0].generate_until(generate) and text[0]  # greedy: the same (non-empty) text
    (length,) = lm.scorer.shapes  # both texts in one batch, padded to a power of two
    assert length & (length - 1) == 0 and lm.scorer.real_tokens < lm.scorer.padded_tokens
    assert scores({"results": {"t": {"alias": "t", "sample_len": 4, "acc,none": 0.5, "acc_stderr,none": 0.1,
                                     "exact_match,strict-match": 1.0}}}) == {
        "eval/t/acc": 0.5, "eval/t/exact_match_strict-match": 1.0}


def test_bad_tasks_are_one_line_errors(tmp_path, monkeypatch):
    import sys

    from shard.training.harness import run_tasks, task_specs

    broken = tmp_path / "broken.yaml"
    broken.write_text("task: [unclosed\n")
    with pytest.raises(ShardError, match="does not parse"):
        task_specs([str(broken)])
    with pytest.raises(ShardError, match="not found"):
        task_specs([str(tmp_path / "missing.yaml")])
    with pytest.raises(ShardError, match="--limit must be positive"):
        run_tasks(None, ["x"], limit=0)
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)  # as if lm-eval were not installed
    monkeypatch.delitem(sys.modules, "shard.training.harness")
    with pytest.raises(ShardError, match=r"./install.sh eval"):
        import shard.training.harness  # noqa: F401


def test_the_training_loop_logs_task_scores(exported, tmp_path):
    from shard.data.tokenizers import load_tokenizer
    from shard.training.loop import train

    folder, task = exported
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((TEXT + "\n") * 40)
    cfg = tiny_config("1x1", steps=2, data__path=str(corpus), data__tokenizer=str(folder),
                      model__vocab_size=load_tokenizer(str(folder)).vocab_size, eval__harness_tasks=[str(task)],
                      eval__harness_every=1, eval__harness_limit=2, checkpoint__every=2,
                      checkpoint__best_metric="eval/tiny_mc/acc", checkpoint__best_mode="max")
    records = train(cfg, devices=devices_for("1x1"))
    assert [r["step"] for r in records if "eval/tiny_mc/acc" in r] == [1, 2]
    assert all(0 <= r["eval/tiny_mc/acc"] <= 1 for r in records)


def test_lm_eval_hf_backend_evaluates_the_export_of_a_run_on_a_bare_tokenizer_json(exported, tmp_path):
    """A run on a tokenizer.json with no tokenizer_config.json beside it exported a tokenizer that
    transformers gave no eos_token, and lm-eval's `hf` backend failed on it (TypeError: 'None' is not an
    instance of 'Sequence', from decode(prefix_token_id))."""
    from lm_eval.models.huggingface import HFLM
    from typer.testing import CliRunner

    from shard.cli.app import app
    from shard.data.tokenizers import train_bpe

    _, task = exported
    train_bpe([TEXT] * 4, 300, tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").unlink()  # tokenizer.json alone, as `tokenizers` saves one
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((TEXT + "\n") * 40)
    run, out = tmp_path / "run", tmp_path / "hf"
    result = CliRunner().invoke(app, ["train", "--data", str(corpus), "--tokenizer", str(tmp_path / "tok" / "tokenizer.json"),
                                      "--model", "tiny", "--steps", "1", "--batch", "8", "--seq", "32", "--mesh", "8x1",
                                      "--run-dir", str(run)])
    assert result.exit_code == 0, result.output
    assert "eos 0 <|endoftext|> (no tokenizer_config.json: taken from its special tokens)" in result.output
    result = CliRunner().invoke(app, ["export-hf", str(run), "--out", str(out)])
    assert result.exit_code == 0 and "and the run's tokenizer" in result.output, result.output
    lm = HFLM(pretrained=str(out), device="cpu", batch_size=4, dtype="float32")
    assert (lm.tokenizer.eos_token, lm.eot_token_id) == ("<|endoftext|>", 0)
    acc, logliks = _evaluate(lm, task)
    assert 0 <= acc <= 1 and len(logliks) == sum(len(c) for _, c, _ in QUESTIONS) and np.isfinite(logliks).all()


def test_ranking_by_a_task_score_needs_the_tasks_at_every_save():
    with pytest.raises(ShardError, match="needs eval.harness_tasks"):
        tiny_config(checkpoint__best_metric="eval/tiny_mc/acc")
    with pytest.raises(ShardError, match="not a multiple of eval.harness_every"):
        tiny_config(checkpoint__best_metric="eval/t/acc", eval__harness_tasks=["t"], eval__harness_every=3,
                    checkpoint__every=4)
    with pytest.raises(ShardError, match="eval/<task>/<metric>"):
        tiny_config(checkpoint__best_metric="eval/acc")


def test_shard_eval_tasks_writes_the_results_json(exported, run_shard, tmp_path):
    """Into the working directory's eval/ (run_shard's is tmp_path, outside any git repository), never
    into the Hugging Face folder (an export); lm-eval's `git describe` says nothing on the console."""
    folder, task = exported
    result = run_shard("eval", str(folder), "--tasks", str(task), "--limit", "2", "--batch", "4", "--json")
    assert result.returncode == 0, result.stderr
    assert "fatal" not in result.stderr, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["results"]["tiny_mc"]["sample_len"] == 2
    written = json.loads((tmp_path / out["file"]).read_text())
    assert written["results"]["tiny_mc"]["acc,none"] == out["results"]["tiny_mc"]["acc,none"]
    assert out["file"].startswith("eval/harness-hf-") and not (folder / "eval").exists()
    bad = run_shard("eval", str(folder), "--tasks", str(task), "--limit", "0")
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --limit must be positive (examples per task), got 0"


def test_results_go_to_out_or_the_run_dir(exported, tmp_path):
    from shard.run.evaluation import results_file

    folder, _ = exported
    assert results_file(str(folder), "S", tmp_path / "o") == tmp_path / "o" / "harness-hf-S.json"
    run = tmp_path / "run" / "checkpoints" / "7" / "state"
    run.mkdir(parents=True)
    assert results_file(str(tmp_path / "run"), "S") == tmp_path / "run" / "eval" / "harness-step7-S.json"


def test_weights_without_a_tokenizer_read_bytes_said_once(tmp_path):
    from flax import nnx

    from shard import models
    from shard.config.presets import PRESETS
    from shard.run import hf
    from shard.run.harness import harness_lm
    from shard.sharding.mesh import parse_mesh

    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=256)
    hf.write_hf_dir(str(tmp_path), cfg, nnx.to_pure_dict(nnx.state(models.build(cfg))))
    notices = []
    lm = harness_lm(tmp_path, tiny_config("1x1"), parse_mesh("1x1"), devices_for("1x1"), 1, notice=notices.append)
    assert len(notices) == 1 and "as bytes" in notices[0]
    assert lm.tok_encode("hi") == [104, 105] and lm.prefix_token_id == 10
