"""Fine-tuning: chat rows rendered with a template and masked to their assistant tokens (task sft), the
loss and gradients that mask gives, DPO against a hand computation, and bad input as one line."""

import json
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from typer.testing import CliRunner

from shard import models
from shard.cli.app import app
from shard.data.batches import split_window
from shard.data.chat import ChatRenderer, chat_template
from shard.data.finetune import dpo_samples, sft_samples
from shard.data.tokenizers import load_tokenizer, train_bpe
from shard.errors import ShardError
from shard.models import llama
from shard.observe.metrics import read_jsonl
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh
from shard.sharding.rules import activation_layout
from shard.testing import devices_for, tiny_config
from shard.training.dpo import jit_dpo_step
from shard.training.state import state_spec
from shard.training.step import batch_sharding, make_loss_fn, schedule_inputs

BYTE = load_tokenizer("byte")


def _chat(a: int, b: int) -> dict:
    return {"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{a}+{b}?"},
                         {"role": "assistant", "content": str(a + b)}, {"role": "user", "content": "sure?"},
                         {"role": "assistant", "content": "yes"}]}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    rng = np.random.default_rng(0)
    nums = rng.integers(1, 10, (32, 2)).tolist()
    (root / "chats.jsonl").write_text("".join(json.dumps(_chat(a, b)) + "\n" for a, b in nums))
    pairs = [{"prompt": f"{a}+{b}?", "chosen": str(a + b), "rejected": str(a + b + 1)} for a, b in nums[:8]]
    pairs.append({"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
                  "rejected": "go away"})  # the chat form, mixed with a string
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return root


def test_assistant_turns_are_the_trained_pieces():
    """Each assistant turn's text is exactly what its prompt (add_generation_prompt) leaves of the whole
    rendering, with any template's special tokens; nothing else is trained."""
    llama3ish = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                 "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    chat = _chat(3, 4)["messages"]
    for template, ends in ((ChatRenderer.of(BYTE, "x").template, "<|im_end|>\n"), (llama3ish, "<|eot_id|>")):
        pieces = ChatRenderer(BYTE, template, "x").pieces(chat, 1)
        assert [t for t, trained in pieces if trained] == ["7" + ends, "yes" + ends]
        ids, flags = ChatRenderer(BYTE, template, "x").encode(chat, 1)
        assert BYTE.decode(ids[flags == 1]) == "7" + ends + "yes" + ends
    # DPO completions: only the turns after the prompt are trained
    pieces = ChatRenderer(BYTE, llama3ish, "x").pieces(chat, 1, trained_from=4)
    assert [t for t, trained in pieces if trained] == ["yes<|eot_id|>"]


def test_sft_trains_exactly_the_assistant_answers(files):
    """In the batch, the targets a loss mask keeps decode to each conversation's assistant answers with
    their end markers, no token more or less (a mask one token off trains on what follows a turn)."""
    batch = split_window(sft_samples(str(files / "chats.jsonl"), BYTE, 256, 0).rows(0, 16))  # a chat a row
    for r in range(16):
        for segment in set(batch["segment_ids"][r].tolist()) - {0}:  # 0: padding
            at = batch["segment_ids"][r] == segment
            a, b = map(int, re.search(r"user\n(\d)\+(\d)\?", BYTE.decode(batch["inputs"][r][at])).groups())
            trained = at & (batch["loss_mask"][r] == 1) & (batch["mask"][r] == 1)
            assert BYTE.decode(batch["targets"][r][trained]) == f"{a + b}<|im_end|>\nyes<|im_end|>\n"


def _tiny_setup(cfg):
    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices_for(cfg.mesh.spec))
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    params = nnx.to_pure_dict(nnx.state(models.build(cfg.model, seed=cfg.seed)))
    return layout, spec, jax.device_put(params, spec.shardings["params"])


def _log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)


def test_sft_loss_counts_assistant_targets_only(files):
    """The loss is the mean next-token loss over assistant targets alone (computed here from the logits),
    its gradients are those of the data mask times the loss mask; a target outside an assistant turn
    (a user's or system's text, as predicted) can change to anything without changing the loss or any
    gradient by one bit, while changing one assistant target does change them."""
    cfg = tiny_config("2x4", data__seq_len=64, task="sft")
    layout, spec, params = _tiny_setup(cfg)
    batch = split_window(sft_samples(str(files / "chats.jsonl"), BYTE, 64, 0).rows(0, 8))
    keep = batch["mask"] * batch["loss_mask"]
    assert 0 < keep.sum() < batch["mask"].sum()  # assistant targets, and others
    loss_fn = make_loss_fn(spec, layout)

    @jax.jit
    def loss_and_grads(p, b):
        with activation_layout(layout):
            (_, (nll, count, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, b)
        return nll / count, grads

    place = lambda b: jax.device_put(b, batch_sharding(layout))  # noqa: E731
    loss, grads = jax.device_get(loss_and_grads(params, place(batch)))
    with activation_layout(layout):
        logits = jax.device_get(llama.forward(cfg.model, params, batch["inputs"], segment_ids=batch["segment_ids"],
                                              positions=batch["positions"])[0])
    logp = np.take_along_axis(_log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
    np.testing.assert_allclose(loss, -(logp * keep).sum() / keep.sum(), rtol=1e-5)

    hand = {k: v for k, v in batch.items() if k != "loss_mask"} | {"mask": keep}
    _, hand_grads = jax.device_get(loss_and_grads(params, place(hand)))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, hand_grads)

    rng = np.random.default_rng(1)
    untrained = batch | {"targets": np.where(keep > 0, batch["targets"],
                                             rng.integers(0, 256, keep.shape)).astype(np.int32)}
    assert (untrained["targets"] != batch["targets"]).any()
    loss2, grads2 = jax.device_get(loss_and_grads(params, place(untrained)))
    assert loss2 == loss
    jax.tree.map(np.testing.assert_array_equal, grads2, grads)

    r, t = map(int, np.argwhere(keep > 0)[0])
    trained = batch | {"targets": batch["targets"].copy()}
    trained["targets"][r, t] = (trained["targets"][r, t] + 1) % 256
    loss3, grads3 = jax.device_get(loss_and_grads(params, place(trained)))
    assert loss3 != loss
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(grads3), jax.tree.leaves(grads)))


def _answers(files) -> set[tuple[str, str]]:
    """pairs.jsonl's (chosen, rejected) answer texts (no pair's reversed is another's: rejected a+b+1)."""
    pairs = [json.loads(line) for line in (files / "pairs.jsonl").read_text().splitlines()]
    text = lambda v: v if isinstance(v, str) else v[0]["content"]  # noqa: E731
    return {(text(p["chosen"]), text(p["rejected"])) for p in pairs}


def test_dpo_loss_matches_a_hand_computation(files):
    """The DPO step's loss and reward metrics equal numpy's from the two models' logits: sequence
    log-probabilities over the completions' tokens, beta-scaled ratios to the reference, -log sigmoid.
    The two rows of a pair are its chosen then its rejected completion (the trained tokens decode to
    them), and the step raises the chosen one's log-probability relative to the rejected one's."""
    beta = 0.5
    cfg = tiny_config("2x4", data__seq_len=64, task="dpo", dpo__beta=beta, optimizer__warmup_steps=0)
    layout, spec, reference = _tiny_setup(cfg)
    samples = dpo_samples(str(files / "pairs.jsonl"), BYTE, 64, 0)
    batch = split_window(samples.rows(0, 8))
    trained = [BYTE.decode(t[m == 1]).split("<|im_end|>")[0] for t, m in zip(batch["targets"], batch["loss_mask"])]
    for k in range(4):  # rows 2k and 2k + 1: a pair's chosen then its rejected answer
        assert (trained[2 * k], trained[2 * k + 1]) in _answers(files), trained
    noise = jax.tree.map(lambda x: 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), reference)
    policy = jax.tree.map(jax.numpy.add, reference, noise)

    def seq_logps(params):
        with activation_layout(layout):
            logits = jax.device_get(llama.forward(cfg.model, params, batch["inputs"])[0])
        logp = np.take_along_axis(_log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
        return (logp * batch["mask"] * batch["loss_mask"]).sum(1)

    before = seq_logps(policy)
    ratio = (before - seq_logps(reference)).reshape(-1, 2)
    chosen, rejected = beta * ratio[:, 0], beta * ratio[:, 1]
    want = {"loss": np.mean(np.log1p(np.exp(-(chosen - rejected)))), "reward_chosen": chosen.mean(),
            "reward_rejected": rejected.mean(), "reward_margin": (chosen - rejected).mean(),
            "accuracy": np.mean(chosen > rejected)}

    state = {"step": jax.numpy.zeros((), jax.numpy.int32), "params": policy,
             "opt_state": spec.tx.init(policy)}
    state = jax.device_put(state, spec.shardings)
    step = jit_dpo_step(spec, layout, beta)
    state, metrics = step(state, jax.device_put(batch, batch_sharding(layout)), schedule_inputs(spec, layout),
                          reference)
    metrics = jax.device_get(metrics)
    for key, value in want.items():
        np.testing.assert_allclose(metrics[key], value, rtol=2e-4, atol=1e-6, err_msg=key)
    moved = (seq_logps(state["params"]) - before).reshape(-1, 2)  # (pairs, chosen|rejected)
    assert (moved[:, 0] - moved[:, 1]).mean() > 0, moved


def test_dpo_pairs_longer_than_seq_lose_their_prompts_start_or_are_left_out(tmp_path):
    """One pair longer than --seq stopped the run: a too-long pair keeps the last dpo.max_prompt_tokens of
    its prompt (as TRL's max_prompt_length), one still too long is left out, the start-up line counts
    both, and only a file where none fits is refused. A pair that fits is kept whole."""
    long_prompt = "".join(str(i % 10) for i in range(100))
    rows = [{"prompt": "1+1?", "chosen": "2", "rejected": "3"},
            {"prompt": long_prompt, "chosen": "yes", "rejected": "no"},
            {"prompt": "hi", "chosen": "x" * 80, "rejected": "y"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = dpo_samples(str(path), BYTE, 96, 0, max_prompt_tokens=40)
    assert samples.source.pairs == 2
    assert samples.describe().endswith("; 1 prompt(s) cut to their last 40 tokens, 1 pair(s) left out, longer than "
                                       "--seq 96 even so)")
    ids, trained = samples.source.rows["tokens"], samples.source.rows["trained"]
    text = [BYTE.decode(row[row >= 0].tolist()) for row in ids]
    assert text[0] == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"  # whole
    suffix = "<|im_end|>\n<|im_start|>assistant\n"  # ChatML's, the last 33 of the prompt's 40 tokens kept
    assert text[2] == long_prompt[-7:] + suffix + "yes<|im_end|>\n" and text[3].endswith(suffix + "no<|im_end|>\n")
    assert int(np.argmax(trained[2] == 1)) == int(np.argmax(trained[3] == 1)) == 40
    with pytest.raises(ShardError, match=r"none of its 3 preference pairs fits --seq 8, even with its prompt cut to "
                                         r"its last 4 tokens \(dpo.max_prompt_tokens\); raise --seq"):
        dpo_samples(str(path), BYTE, 8, 0)


def test_bad_pair_rows_and_chat_templates_are_one_line(tmp_path):
    """A pair without `rejected`; a chat_template that is no template (a number, a list without a
    "default") fell back to ChatML without a word."""
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(ShardError, match="line 1 has no 'rejected'"):
        dpo_samples(str(tmp_path / "pairs.jsonl"), BYTE, 64, 0)
    train_bpe(["hi there"] * 4, 300, tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    for template, said in ((42, "got int 42"), ([{"name": "tool_use", "template": "x"}],
                                                'got a list without a string template named "default"')):
        (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
        with pytest.raises(ShardError, match=f"tokenizer_config.json: chat_template must be a template .*{said}"):
            chat_template(load_tokenizer(str(tmp_path / "tok")))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": [
        {"name": "default", "template": "{{ messages }}"}]}))
    assert chat_template(load_tokenizer(str(tmp_path / "tok"))) == "{{ messages }}"


TINY = ["--model", "tiny", "--batch", "8", "--seq", "64", "--mesh", "8x1", "--log-every", "1"]


def test_sft_then_dpo_from_its_checkpoint_and_a_dpo_resume(files, tmp_path):
    """The command line end to end: sft from scratch, then dpo --init-from its checkpoint, whose
    records carry the reward metrics, starting at the reference (loss log 2, margin 0). That DPO run
    resumed from its step 1 redoes step 2 bit for bit: its reference is the --init-from weights again
    (not the seed's fresh init, as a resume once took)."""
    sft = CliRunner().invoke(app, ["train", "--task", "sft", "--data", str(files / "chats.jsonl"), *TINY,
                                   "--steps", "2", "--run-dir", str(tmp_path / "sft")])
    assert sft.exit_code == 0, sft.output
    dpo_run = ["train", "--task", "dpo", "--data", str(files / "pairs.jsonl"), *TINY, "--steps", "2",
               "--init-from", str(tmp_path / "sft" / "checkpoints" / "2"), "--run-dir", str(tmp_path / "dpo")]
    dpo = CliRunner().invoke(app, [*dpo_run, "--checkpoint-every", "1", "--set", "optimizer.warmup_steps=0"])
    assert dpo.exit_code == 0, dpo.output
    records = read_jsonl(tmp_path / "dpo" / "metrics.jsonl")
    first = records[0]
    assert first["loss"] == pytest.approx(np.log(2), abs=1e-6) and first["reward_margin"] == pytest.approx(0, abs=1e-6)
    assert {"reward_chosen", "reward_rejected", "accuracy"} <= set(first)
    assert "reward margin" in dpo.output
    shutil.rmtree(tmp_path / "dpo" / "checkpoints" / "2")
    resumed = CliRunner().invoke(app, [*dpo_run, "--checkpoint-every", "1", "--set", "optimizer.warmup_steps=0",
                                       "--resume"])
    assert resumed.exit_code == 0 and "resumed from step 1" in resumed.output, resumed.output
    again = [r for r in read_jsonl(tmp_path / "dpo" / "metrics.jsonl") if r.get("step") == 2][-1]
    assert again["reward_margin"] != 0 and again["loss"] == records[1]["loss"], (again, records[1])


def test_a_fine_tune_reads_its_data_with_the_tokenizer_its_weights_came_with(files, tmp_path):
    """--init-from a Hugging Face folder holding its own BPE tokenizer: SFT reads the chats with that
    tokenizer (not bytes), the start-up line says where it came from and the run keeps it; DPO from that
    run reads with it again; a --tokenizer that is another one is refused in one line."""
    import dataclasses

    from shard.config.presets import PRESETS
    from shard.run import hf

    base = tmp_path / "base"
    tok = train_bpe((json.dumps(_chat(a, b)) for a in range(1, 10) for b in range(1, 10)), 300, base)
    model = dataclasses.replace(PRESETS["tiny"], vocab_size=tok.vocab_size)
    hf.write_hf_dir(str(base), model, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(models.build(model)))))
    train = ["train", *TINY[2:], "--steps", "1"]  # the model is the weights'
    sft = CliRunner().invoke(app, [*train, "--task", "sft", "--data", str(files / "chats.jsonl"), "--init-from",
                                   str(base), "--run-dir", str(tmp_path / "sft")])
    assert sft.exit_code == 0, sft.output
    assert f"tokenizer huggingface (300 ids, eos 0) from {base}" in sft.output, sft.output
    assert load_tokenizer(str(tmp_path / "sft" / "tokenizer")).fingerprint == tok.fingerprint
    dpo = CliRunner().invoke(app, [*train, "--task", "dpo", "--data", str(files / "pairs.jsonl"), "--init-from",
                                   str(tmp_path / "sft"), "--run-dir", str(tmp_path / "dpo")])
    assert dpo.exit_code == 0, dpo.output
    assert f"tokenizer huggingface (300 ids, eos 0) from {tmp_path / 'sft' / 'tokenizer'}" in dpo.output, dpo.output
    refused = CliRunner().invoke(app, [*train, "--task", "sft", "--data", str(files / "chats.jsonl"), "--init-from",
                                       str(base), "--tokenizer", "byte", "--run-dir", str(tmp_path / "bytes")])
    assert refused.exit_code == 2 and refused.output.count("error:") == 1, refused.output
    assert (f"--tokenizer byte is the byte tokenizer byte, not the huggingface tokenizer {tok.fingerprint} the "
            f"weights in {base} came with") in refused.output, refused.output


def test_dpo_with_lora_takes_the_base_as_its_reference(files, tmp_path):
    """With LoRA the reference is the base weights with the adapters left out (no second copy): the first
    step starts at it (B is zero: loss log 2, margin 0), and once the adapters have moved the policy
    differs from it (margin not 0), which a reference that kept the adapters would never show."""
    sft = CliRunner().invoke(app, ["train", "--task", "sft", "--data", str(files / "chats.jsonl"), *TINY,
                                   "--steps", "1", "--run-dir", str(tmp_path / "sft")])
    assert sft.exit_code == 0, sft.output
    dpo = CliRunner().invoke(app, ["train", "--task", "dpo", "--data", str(files / "pairs.jsonl"), *TINY,
                                   "--steps", "3", "--init-from", str(tmp_path / "sft" / "checkpoints" / "1"),
                                   "--set", "lora.rank=4", "--set", "lora.targets=wq,wv,w_up",
                                   "--set", "optimizer.lr=1e-2", "--run-dir", str(tmp_path / "dpo")])
    assert dpo.exit_code == 0, dpo.output
    records = read_jsonl(tmp_path / "dpo" / "metrics.jsonl")
    assert records[0]["loss"] == pytest.approx(np.log(2), abs=1e-6) and records[0]["reward_margin"] == 0
    assert abs(records[-1]["reward_margin"]) > 1e-4, records


@pytest.mark.parametrize("task,rows,message", [
    ("sft", [{"messages": [{"role": "user", "content": "hi"}]}], "line 1: a conversation without an assistant turn"),
    ("sft", [{"text": "hi"}], "line 1 has no 'messages'"),
    ("sft", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "!"}]}],
     "line 1: the chat template failed to render this conversation (TemplateError: no system turn)"),
    # refused before anything is read: they were ignored (packing), or trained against a random reference
    ("sft", [{"text": "hi"}], "task sft packs conversations into rows with attention and positions restarting"),
    ("dpo", [{"prompt": "a", "chosen": "b", "rejected": "c"}], "task dpo needs --init-from: its reference model is"),
    ("dpo", [{"prompt": "a", "chosen": "b", "rejected": "c"}], "task dpo gives each sequence a row of its own"),
])
def test_bad_finetuning_rows_are_one_line(files, tmp_path, task, rows, message):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = ["--tokenizer", "byte"]
    if "template" in message:  # a tokenizer whose template raises, as templates do on input they refuse
        folder = tmp_path / "tok"
        train_bpe(["hi there"] * 4, 300, folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = "{{ raise_exception('no system turn') }}"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        tokenizer = ["--tokenizer", str(folder)]
    more = ["--packing", "concat"] if "packs" in message or "row of its own" in message else []
    result = CliRunner().invoke(app, ["train", "--task", task, "--data", str(path), *tokenizer, *TINY, "--steps", "1",
                                      "--run-dir", str(tmp_path / "run"), *more])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in result.output, result.output


def test_a_saved_config_naming_packing_is_no_packing_flag():
    """A run's config.toml names every key, packing = "concat" too: given as --config it is not refused."""
    from shard.run.start import _check_task

    cfg = tiny_config("1x1", task="sft")
    _check_task(cfg, {"data": {"packing": "concat"}}, {"data": {"packing": "concat"}})
    with pytest.raises(ShardError, match="task sft packs conversations"):
        _check_task(cfg, {"data": {"packing": "concat"}}, {})
