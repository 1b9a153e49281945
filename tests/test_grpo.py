"""GRPO (task grpo): the loss terms equal a NumPy computation on a fixed batch of rollouts."""

import dataclasses

import numpy as np
import pytest

from shard.config.finetune import GrpoConfig
from shard.training import grpo

P, G, T = 3, 4, 5  # prompts, completions per prompt, target positions


def _batch():
    rng = np.random.default_rng(0)
    rewards = np.array([1, 0, 0, 1, 2, 2, 2, 2, 0.5, 0, 1, 0], np.float32)  # the middle group: no signal
    mask = np.ones((P * G, T), np.float32)
    mask[:, :2] = 0  # the prompt's targets
    mask[3, 4:] = 0  # a short completion; its padding
    logp = rng.normal(-1.5, 0.5, (P * G, T)).astype(np.float32)
    old = logp + rng.normal(0, 0.3, logp.shape).astype(np.float32)
    sampler = old + rng.normal(0, 0.5, logp.shape).astype(np.float32)
    reference = logp + rng.normal(0, 0.2, logp.shape).astype(np.float32)
    truncated = np.array([0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0], bool)
    return rewards, truncated, dict(mask=mask, old=old, sampler=sampler, reference=reference), logp


def _np_advantages(rewards, normalise):
    r = rewards.reshape(P, G)
    adv = r - r.mean(1, keepdims=True)
    if normalise:
        adv = adv / (r.std(1, ddof=1, keepdims=True) + 1e-4)
    return adv.reshape(-1)


@pytest.mark.parametrize("normalise", [True, False])
def test_advantages_are_each_reward_less_its_group_mean_over_its_std(normalise):
    rewards = _batch()[0]
    got = np.asarray(grpo.group_advantages(rewards, G, normalise))
    np.testing.assert_allclose(got, _np_advantages(rewards, normalise), rtol=1e-5, atol=1e-6)
    assert not got[4:8].any()  # an all-equal group has no advantage, scaled or not


def test_filters_leave_out_groups_without_signal_and_truncated_completions():
    rewards, truncated, _, _ = _batch()
    cfg = GrpoConfig(filter_zero_advantage=True, filter_truncated=True)
    keep = np.asarray(grpo.kept_sequences(rewards, truncated, G, cfg))
    np.testing.assert_array_equal(keep, [1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 1])
    off = GrpoConfig(filter_zero_advantage=False, filter_truncated=False)
    assert np.asarray(grpo.kept_sequences(rewards, truncated, G, off)).all()


def _np_loss(logp, rollout, adv, keep, cfg):
    """The loss written out in NumPy from docs/formulas.md#grpo."""
    mask = rollout["mask"] * keep[:, None]
    ratio = np.exp(logp - rollout["old"])
    a = adv[:, None]
    surrogate = -np.minimum(ratio * a, np.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * a)
    weight = np.minimum(np.exp(rollout["old"] - rollout["sampler"]), cfg.tis_cap) if cfg.tis_cap else 1.0
    r = rollout["reference"] - logp
    kl = np.exp(r) - r - 1
    per_token = surrogate * weight + cfg.kl_beta * kl
    sums, tokens = (per_token * mask).sum(1), mask.sum(1)
    if cfg.loss_norm == "token":
        loss = sums.sum() / tokens.sum()
    elif cfg.loss_norm == "sequence":
        loss = (sums[tokens > 0] / tokens[tokens > 0]).mean()
    else:
        loss = sums.sum() / ((tokens > 0).sum() * cfg.max_new_tokens)
    low = ((ratio < 1 - cfg.clip_low) & (a < 0) & (mask > 0)).sum() / mask.sum()
    high = ((ratio > 1 + cfg.clip_high) & (a > 0) & (mask > 0)).sum() / mask.sum()
    return loss, (kl * mask).sum() / mask.sum(), low, high


@pytest.mark.parametrize("settings", [
    dict(loss_norm="token", clip_high=0.28, kl_beta=0.04, tis_cap=2.0),  # DAPO's clip-higher, with KL
    dict(loss_norm="sequence", kl_beta=0.0, tis_cap=0.0),  # the original GRPO's normaliser, no KL, no TIS
    dict(loss_norm="constant", max_new_tokens=T, normalise_advantages=False, filter_zero_advantage=False),
])
def test_the_clipped_surrogate_kl_and_normalisers_equal_numpy(settings):
    cfg = dataclasses.replace(GrpoConfig(), **settings)
    rewards, truncated, rollout, logp = _batch()
    adv = _np_advantages(rewards, cfg.normalise_advantages)
    keep = np.asarray(grpo.kept_sequences(rewards, truncated, G, cfg))
    logits = np.random.default_rng(1).normal(0, 2, (P * G, T, 7)).astype(np.float32)
    logits[0, 3, 0] = -np.inf  # a token the policy never draws: p log p = 0, no NaN
    logp_v = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    entropy = grpo.token_entropy(logp_v)  # the policy's entropy per position, from its log-probabilities
    total, count, metrics = grpo.grpo_loss(logp, rollout | {"advantages": adv, "keep": keep}, cfg, entropy)
    loss, kl, low, high = _np_loss(logp, rollout, adv, keep, cfg)
    np.testing.assert_allclose(float(total / count), loss, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["kl"]), kl if cfg.kl_beta else 0.0, rtol=1e-5)
    mask = rollout["mask"] * keep[:, None]  # the mean over the kept completions' tokens
    want = (-(np.exp(logp_v) * np.where(np.isfinite(logp_v), logp_v, 0)).sum(-1) * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(metrics["entropy"]), want, rtol=1e-5)
    assert (float(metrics["clip_low"]), float(metrics["clip_high"])) == pytest.approx((low, high))
    assert low > 0 and high > 0  # the batch reaches both clip bounds: the test reads both


def test_the_gradient_of_a_token_outside_the_clip_is_zero():
    """PPO's point: once the ratio passes 1 + clip_high with A > 0 the token pushes no further."""
    import jax

    cfg = GrpoConfig(clip_high=0.2, tis_cap=0.0)
    rollout = {"mask": np.ones((2, 1), np.float32), "old": np.zeros((2, 1), np.float32),
               "sampler": np.zeros((2, 1), np.float32), "advantages": np.array([1.0, 1.0], np.float32),
               "keep": np.ones(2, np.float32)}
    logp = np.array([[0.1], [0.5]], np.float32)  # ratios 1.105 (inside) and 1.65 (clipped)
    grads = jax.grad(lambda lp: grpo.grpo_loss(lp, rollout, cfg)[0])(logp)
    np.testing.assert_allclose(np.asarray(grads), [[-np.exp(0.1)], [0.0]], rtol=1e-6)


def test_the_built_in_rewards_extract_the_final_answer():
    from shard.training import rewards as rw

    gsm = {"answer": "Half of 48 is 24.\n#### 1,024"}  # GSM8K's answer field: the solution, then ####
    assert rw.BUILTIN["answer"](gsm, "#### 12 at first\nso we get\n#### 1024.") == 1.0
    assert rw.BUILTIN["answer"](gsm, "#### 1023") == 0.0 and rw.BUILTIN["answer"](gsm, "1024") == 0.0
    assert rw.BUILTIN["boxed"]({"answer": "\\frac{1}{2}"}, "x \\boxed{1} then \\boxed{\\frac{1}{2}}.") == 1.0
    assert rw.BUILTIN["boxed"]({"answer": 3}, "\\boxed{3") == 0.0  # never closed
    assert rw.BUILTIN["last_number"]({"answer": 7}, "3 + 4 = 7.0 apples") == 1.0
    fmt = rw.load_rewards(("format=0.5",), r"^<think>.*</think>")[0]
    assert (fmt.weight, fmt.fn({}, "<think>hm</think> 7"), fmt.fn({}, "7")) == (0.5, 1.0, 0.0)


def test_user_rewards_are_summed_with_weights_and_their_faults_are_one_line(tmp_path):
    from shard.errors import ShardError
    from shard.training import rewards as rw

    (tmp_path / "mine.py").write_text("def length(row, text):\n    return len(text)\n"
                                      "def picky(row, text):\n    return 1 / int(row['n'])\n"
                                      "def words(row, text):\n    return text.split()\n")
    mine = str(tmp_path / "mine.py")
    loaded = rw.load_rewards((f"{mine}:length=0.1", "last_number"))
    scores = rw.score(loaded, [(1, {"answer": 2}), (2, {"answer": 5})], ["1 2", "five"], "p.jsonl")
    np.testing.assert_allclose(scores, [[3, 1], [4, 0]])
    np.testing.assert_allclose(rw.total(loaded, scores), [1.3, 0.4], rtol=1e-6)
    assert rw.per_reward_stats(loaded, scores) == {f"reward/{mine}:length": 3.5, f"reward_std/{mine}:length": 0.5,
                                                   "reward/last_number": 0.5, "reward_std/last_number": 0.5}
    faults = {
        (f"{mine}:picky",): ("p.jsonl line 7: reward", "raised ZeroDivisionError: division by zero"),
        (f"{mine}:words",): ("p.jsonl line 7: reward", "returned ['a'], not a finite number"),
        ("answer",): ("p.jsonl line 7: reward answer: the row has no 'answer' field", ""),
        ("no_such_module_x:f",): ("reward no_such_module_x:f: no module 'no_such_module_x'", ""),
        (f"{mine}:absent",): (f"reward {mine}:absent: {mine} has no function 'absent'", ""),
        ("format",): ("reward format needs grpo.format_pattern", ""), ("exact",): ("reward 'exact' is none of", ""),
        (): ("task grpo needs a reward", ""), ("answer=x",): ("a reward is NAME or NAME=WEIGHT", ""),
    }
    for specs, (start, end) in faults.items():
        with pytest.raises(ShardError) as e:
            rw.score(rw.load_rewards(specs), [(7, {"n": 0})], ["a"], "p.jsonl")
        message = str(e.value)
        assert message.startswith(start) and message.endswith(end) and "\n" not in message, message


def test_prompt_messages_are_rendered_as_sft_renders_a_prompt_and_bad_files_are_one_line(tmp_path):
    import json

    from shard.data.chat import DEFAULT_CHAT_TEMPLATE, read_prompts
    from shard.data.tokenizers import load_tokenizer
    from shard.errors import ShardError

    byte = load_tokenizer("byte")
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "2+2?", "answer": 4}, {"messages": [{"role": "system", "content": "be brief"},
                                                          {"role": "user", "content": "3+3?"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = read_prompts(str(path), byte, 100)
    assert [p.line for p in prompts] == [1, 2] and prompts[0].row == rows[0]
    assert byte.decode(prompts[0].ids) == "2+2?"  # a string: the text a base model continues, as TRL reads it
    assert "<|im_start|>system\nbe brief" in byte.decode(prompts[1].ids) and "im_start" in DEFAULT_CHAT_TEMPLATE
    for text, says in [('{"question": "x"}', "line 1 has no 'prompt'"), ('{"prompt": 3}', "'prompt' must be a string or"),
                       ("[1]", "line 1 is not a JSON object"), ('{"prompt": "' + "x" * 101 + '"}', "raise --seq"), ('{"prompt": ""}', "renders to no tokens")]:
        path.write_text(text + "\n")
        with pytest.raises(ShardError, match=says):
            read_prompts(str(path), byte, 100)


def test_grpo_raises_a_toy_reward_resumes_bit_for_bit_and_matches_another_layout(tmp_path):
    """`shard train --task grpo` end to end on a toy verifiable task (the share of lower-case letters in
    8 sampled bytes) from a random tiny model: the mean reward climbs within 6 steps on 2x4; resumed from
    its step 3 checkpoint, steps 4-6 are the same records (the same prompts and sampling keys); and
    step 1 trained on fsdp and sampled on 2x4 (grpo.rollout_mesh), and trained and sampled on 1x1 (one of
    the 8 devices), draws the same completions and takes the same update."""
    import json
    import shutil

    from typer.testing import CliRunner

    import shard
    from shard import config
    from shard.cli.app import app
    from shard.observe.metrics import read_jsonl
    from shard.testing import devices_for

    (tmp_path / "toy.py").write_text("def lower(row, text):\n    return sum('a' <= c <= 'z' for c in text) / len(text)\n")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"word {i}:"}) + "\n" for i in range(8)))
    args = ["train", "--task", "grpo", "--data", str(tmp_path / "prompts.jsonl"), "--reward", f"{tmp_path}/toy.py:lower",
            "--model", "tiny", "--batch", "16", "--seq", "32", "--log-every", "1", "--set", "optimizer.lr=2e-2",
            "--set", "optimizer.warmup_steps=0", "--set", "grpo.max_new_tokens=8", "--set", "grpo.updates_per_batch=2"]

    def run(mesh: str, steps: int, name: str, *more: str) -> list[dict]:
        done = CliRunner().invoke(app, [*args, "--mesh", mesh, "--steps", str(steps), "--run-dir", str(tmp_path / name),
                                        *more])
        assert done.exit_code == 0, done.output
        return [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "reward" in r]

    records = run("2x4", 6, "a", "--checkpoint-every", "3")
    rewards = [r["reward"] for r in records]
    assert rewards[0] < 0.2 and rewards[-1] > 0.4, rewards  # bytes at random: 26/256 lower-case
    # the sampler's log-probabilities are the trainer's, token for token (a shift by one would be ~1 apart)
    assert max(r["logp_gap"] for r in records) < 1e-4 and records[0]["tis_clipped"] == 0
    assert records[-1]["kl"] == 0 and records[-1]["completion_length"] == 8
    assert {"reward/" + f"{tmp_path}/toy.py:lower", "reward_std/" + f"{tmp_path}/toy.py:lower"} <= set(records[0])
    # the policy's entropy over the completions: at most uniform bytes' log 256, narrower as it learns
    entropy = [r["entropy"] for r in records]
    assert 0 < entropy[-1] < entropy[0] <= np.log(256), entropy
    written = read_jsonl(tmp_path / "a" / "completions.jsonl")  # a few completions a logged step, beside the metrics
    assert [len(w["completions"]) for w in written] == [4] * 6 and "completions" not in records[0]
    assert {"line", "completion", "reward"} == set(written[-1]["completions"][0])
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "6")
    again = run("2x4", 6, "a", "--checkpoint-every", "3", "--resume")[-3:]
    keys = ("step", "loss", "grad_norm", "reward", "reward_std", "clip_low", "clip_high")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in records[3:]]
    fsdp = run("fsdp", 1, "b", "--set", "grpo.rollout_mesh=2x4")[0]  # sampled on another layout than it trains on
    assert read_jsonl(tmp_path / "b" / "completions.jsonl")[0] == written[0]  # the same completions
    # 1x1 on one of this process's 8 devices (the CLI takes them all): the library call, run a's config
    saved = config.resolve(config.layer(config.load_file(str(tmp_path / "a" / "config.toml")), {}, {},
                                        ["mesh.spec=1x1", "steps=1"]))
    single = shard.train(saved, devices=devices_for("1x1"))[0]
    assert single["completions"] == written[0]["completions"]
    for one in (fsdp, single):  # the same update: step 1's second update reads the params its first one left
        assert one["reward"] == records[0]["reward"]
        assert (one["loss"], one["grad_norm"]) == pytest.approx((records[0]["loss"], records[0]["grad_norm"]), rel=1e-5)


def test_a_missing_reward_function_stops_grpo_before_it_compiles(tmp_path):
    from typer.testing import CliRunner

    from shard.cli.app import app

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    done = CliRunner().invoke(app, ["train", "--task", "grpo", "--data", str(tmp_path / "prompts.jsonl"), "--model",
                                    "tiny", "--mesh", "8x1", "--batch", "8", "--seq", "32", "--reward", "math:nothing",
                                    "--set", "grpo.max_new_tokens=4", "--run-dir", str(tmp_path / "run")])
    assert done.exit_code == 2 and "reward math:nothing: math has no function 'nothing'" in done.output, done.output
    assert "compiling" not in done.output


def test_a_lora_run_samples_with_its_adapters():
    """GRPO's sampler reads the state's params as they are: with LoRA it adds the adapters' term (the same
    completions as the weights with the adapters folded in), and without them it would sample the base."""
    import jax

    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.testing import devices_for, tiny_config
    from shard.training import lora
    from shard.training.generate import Generator, Sampling
    from shard.training.state import compile_init, state_spec

    cfg = tiny_config("1x1", lora__rank=4)
    layout = make_layout(cfg, parse_mesh("1x1"), devices_for("1x1"))
    spec = state_spec(cfg.model, cfg.optimizer, 1, layout, lora=cfg.lora)
    params = compile_init(spec, cfg.model, 0)()["params"]
    adapters, base = lora.split(params)
    adapters = jax.tree.map(lambda x: x + 0.3, adapters)  # B starts at 0: no term to see
    plain = state_spec(cfg.model, cfg.optimizer, 1, layout).graphdef
    folded = lora.fold(jax.device_get(lora.merge(adapters, base)), cfg.lora)
    key, s = jax.random.key(3), Sampling(1.0)
    with_adapters = Generator(cfg.model, spec.graphdef, lora.merge(adapters, base), layout, 16, lora=cfg.lora)
    got = jax.device_get(with_adapters.group([5, 6, 7], 2, 4, s, key))
    want = jax.device_get(Generator(cfg.model, plain, folded, layout, 16).group([5, 6, 7], 2, 4, s, key))
    without = jax.device_get(Generator(cfg.model, plain, base, layout, 16).group([5, 6, 7], 2, 4, s, key))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert np.abs(got[1] - without[1]).max() > 1e-2


def test_completions_end_at_their_end_of_text_and_sit_after_their_prompt():
    from shard.data.chat import Prompt
    from shard.training.rollouts import completion_ends, per_target, place_rows

    completions = np.array([[5, 9, 7], [5, 6, 7]], np.int32)  # 9: the end of text
    ends, truncated = completion_ends(completions, eos_id=9)
    np.testing.assert_array_equal(ends, [2, 3])
    np.testing.assert_array_equal(truncated, [False, True])
    prompts = [Prompt(1, {}, np.array([1, 2], np.int32))]
    rows, trained = place_rows(prompts, completions, ends, seq_len=5)
    np.testing.assert_array_equal(rows, [[1, 2, 5, 9, -1, -1], [1, 2, 5, 6, 7, -1]])
    np.testing.assert_array_equal(trained, [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]])
    # a completion's token j is the target at position len(prompt) + j - 1
    np.testing.assert_allclose(per_target(np.array([[0.1, 0.2, 0.3]] * 2), prompts, 2, 5)[0], [0, 0.1, 0.2, 0.3, 0])
