"""DeepSeek-V3's architecture as config data: multi-head latent attention against a plain reference (and
its latent cache against no cache), group-limited routing over random scores, parity with transformers'
DeepseekV3ForCausalLM (logits and greedy tokens, on one device and expert parallel; export back to the
same tensors), the tiny twin's layouts agreeing, and the configs it refuses in one line."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shard.config.params import mla_params
from shard.config.presets import PRESETS
from shard.models import llama, mla, moe
from shard.models.layers import rope_tables
from shard.run import hf
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh
from shard.sharding.rules import activation_layout
from shard.testing import devices_for, loss_and_grads, tiny_config
from shard.training.state import state_spec

TINY = PRESETS["deepseek-v3-tiny"]


def _reference_mla(h, p, cfg, positions):
    """MLA written out in float64 numpy, head by head: keys and values up-projected from the latent, the
    RoPE key shared by every head, a causal softmax; RoPE in halves."""
    h = np.asarray(h, np.float64)
    P, N = cfg.qk_nope_head_dim, cfg.n_heads
    C = cfg.kv_lora_rank

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * np.asarray(w, np.float64)

    def rope(x):  # (T, R)
        R = x.shape[-1]
        inv = 1.0 / cfg.rope_theta ** (np.arange(0, R, 2) / R)
        ang = positions[:, None] * inv[None]
        x1, x2 = x[:, : R // 2], x[:, R // 2:]
        return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)

    w = {k: np.asarray(v, np.float64) for k, v in p.items()}
    q = np.einsum("tq,qnh->tnh", rms(h @ w["wq_a"], w["q_a_norm"]), w["wq_b"])
    ckv_kr = h @ w["wkv_a"]
    ckv, kr = rms(ckv_kr[:, :C], w["kv_a_norm"]), rope(ckv_kr[:, C:])
    kv = np.einsum("tc,cnx->tnx", ckv, w["wkv_b"])
    T = h.shape[0]
    out = np.zeros((T, N, cfg.v_head_dim))
    for n in range(N):
        qn = np.concatenate([q[:, n, :P], rope(q[:, n, P:])], -1)
        kn = np.concatenate([kv[:, n, :P], kr], -1)
        s = qn @ kn.T / np.sqrt(cfg.head_dim)
        s = np.where(np.tril(np.ones((T, T))) > 0, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        out[:, n] = (a / a.sum(-1, keepdims=True)) @ kv[:, n, P:]
    return out


def test_mla_equals_a_plain_reference_with_and_without_the_latent_cache():
    cfg, T = TINY, 12
    rng = np.random.default_rng(0)
    p = {name: jnp.asarray(rng.normal(0, 0.3, spec.shape) + (1.0 if "norm" in name else 0.0), jnp.float32)
         for name, spec in mla_params(cfg).items() if name != "wo"}
    h = jnp.asarray(rng.normal(0, 1, (1, T, cfg.d_model)), jnp.float32)
    cos, sin = rope_tables(jnp.arange(T), cfg)
    want = _reference_mla(h[0], p, cfg, np.arange(T, dtype=np.float64))
    attend = jax.jit(lambda h, cos, sin, cache, start: mla.mla_attention(h, p, cos, sin, cfg, jnp.float32, cache,
                                                                         start))
    got, _ = attend(h, cos, sin, None, 0)
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-4, atol=1e-5)
    # the latent cache: a prefill of 8, then one token at a time, the up-projections absorbed
    cache = {"ckv": jnp.zeros((1, T, cfg.kv_lora_rank)), "k_rope": jnp.zeros((1, T, cfg.qk_rope_head_dim))}
    outs = []
    for start, stop in ((0, 8), *((t, t + 1) for t in range(8, T))):
        o, cache = attend(h[:, start:stop], cos[start:stop], sin[start:stop], cache, start)
        outs.append(o)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)[0]), want, rtol=1e-4, atol=1e-5)


def test_group_limited_routing_never_picks_an_expert_outside_the_chosen_groups():
    cfg = dataclasses.replace(TINY, n_experts=32, router_groups=8, router_topk_groups=3, experts_per_token=6)
    rng = np.random.default_rng(0)
    scores = rng.random((4, 64, 32)).astype(np.float32)
    bias = rng.normal(0, 0.3, 32).astype(np.float32)
    gates, experts = moe.top_k_gates(jnp.asarray(scores), cfg, jnp.asarray(bias))
    choose = (scores + bias).reshape(4, 64, 8, 4)
    group_score = np.sort(choose, -1)[..., -2:].sum(-1)  # (B, T, G): each group's two best
    best_groups = np.argsort(-group_score, -1)[..., :3]
    experts = np.asarray(experts)
    assert np.all(np.any(experts[..., :, None] // 4 == best_groups[..., None, :], -1))
    # and within those groups, the 6 best by score + bias; gated by the scores alone, renormalised and scaled
    kept = (np.arange(8)[:, None] == best_groups[..., None, :]).any(-1)  # (B, T, G)
    masked = np.where(kept[..., None], choose, -np.inf)
    want = np.sort(np.argsort(-masked.reshape(4, 64, 32), -1)[..., :6], -1)
    np.testing.assert_array_equal(np.sort(experts, -1), want)
    np.testing.assert_allclose(np.asarray(gates).sum(-1), cfg.routed_scale, rtol=1e-5)
    # without the limit the best 6 experts lie outside those groups for many tokens
    _, free = moe.top_k_gates(jnp.asarray(scores), dataclasses.replace(cfg, router_groups=1, router_topk_groups=1),
                              jnp.asarray(bias))
    assert not np.array_equal(np.sort(np.asarray(free), -1), want)


@pytest.mark.parametrize("change, message", [
    ({"qk_rope_head_dim": 7, "head_dim": 15}, "model.qk_rope_head_dim must be even and positive for RoPE, got 7"),
    ({"router_topk_groups": 5}, r"model.router_topk_groups \(5\) must be at most model.router_groups \(4\)"),
    ({"router_groups": 3}, "model.router_groups=3 must divide model.n_experts"),
    ({"head_dim": 32}, r"model.head_dim \(32\) must be qk_nope_head_dim \+ qk_rope_head_dim"),
    ({"kv_lora_rank": 0}, "model.q_lora_rank=32 needs multi-head latent attention"),
])
def test_bad_configs_are_one_line(change, message):
    problems = dataclasses.replace(TINY, **change).validate()
    assert problems and "\n" not in problems[0]
    assert re.search(message, problems[0]), problems


@pytest.mark.parametrize("sets, message", [
    (["model.qk_rope_head_dim=7", "model.head_dim=15"], "model.qk_rope_head_dim must be even and positive for RoPE"),
    (["model.router_topk_groups=5"], "model.router_topk_groups (5) must be at most model.router_groups (4)"),
    (["lora.rank=4"], "lora.targets: 'wq' is not a weight of deepseek-v3-tiny's multi-head latent attention"),
    (["model.name=tiny", "model.mtp_depth=1", "mesh.spec=pipeline"],
     "pipeline: multi-token prediction (model.mtp_depth) is not pipelined yet"),
])
def test_bad_configs_exit_2_in_one_line(tmp_path, sets, message):
    from typer.testing import CliRunner

    from shard.cli.app import app

    args = ["train", "--model", "deepseek-v3-tiny", "--mesh", "1x1", "--run-dir", str(tmp_path / "run")]
    result = CliRunner().invoke(app, args + [x for s in sets for x in ("--set", s)])
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_mtp_loss_equals_a_hand_computation():
    """Two modules on the tiny model: module k reads the token k + 1 ahead, normalises it and the previous
    hidden state, projects them, runs one decoder layer (run_layers, checked elsewhere) and predicts the
    token k + 2 ahead through its norm and the tied head; the loss function adds their mean, weighted, to
    the objective and reports it."""
    from flax import nnx

    from shard import models
    from shard.training.step import make_loss_fn

    cfg = dataclasses.replace(PRESETS["tiny"], mtp_depth=2, mtp_loss_weight=0.5)
    params = nnx.to_pure_dict(nnx.state(models.build(cfg, seed=0)))
    rng = np.random.default_rng(0)
    B, T = 2, 12
    batch = {"inputs": rng.integers(0, 256, (B, T)), "targets": rng.integers(0, 256, (B, T)),
             "mask": (rng.random((B, T)) > 0.2).astype(np.float32)}

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * np.asarray(w)

    h = np.asarray(jax.jit(lambda p, t: llama.forward_hidden(cfg, p, t)[0])(params, batch["inputs"]))
    table, m = np.asarray(params["embed"]), params["mtp"]
    losses = []
    for k in range(2):
        ahead = np.concatenate([batch["inputs"][:, k + 1:], batch["inputs"][:, :k + 1]], 1)
        x = np.concatenate([rms(table[ahead], m["enorm"][k]), rms(h, m["hnorm"][k])], -1) @ np.asarray(m["eh_proj"][k])
        layer = jax.tree.map(lambda a, k=k: a[k:k + 1], m["layers"])
        h = np.asarray(jax.jit(lambda lay, x: llama.run_layers(cfg, lay, x)[0])(layer, jnp.asarray(x, jnp.float32)))
        logits = rms(h, m["norm"][k]) @ table[:cfg.vocab_size].T
        logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        n = T - k - 1  # positions whose target (k + 1 on) lies in the row
        target, mask = batch["targets"][:, k + 1:], batch["mask"][:, k + 1:]
        nll = -np.take_along_axis(logp[:, :n], target[..., None], -1)[..., 0]
        losses.append(np.sum(nll * mask) / np.sum(mask))
    want = np.mean(losses)
    tc = tiny_config("1x1")
    layout = make_layout(tc, parse_mesh("1x1"), devices_for("1x1"))
    loss_fn = make_loss_fn(state_spec(cfg, tc.optimizer, 3, layout), layout)
    objective, (nll, count, stats) = jax.jit(loss_fn)(params, {k: jnp.asarray(v) for k, v in batch.items()})
    np.testing.assert_allclose(stats["mtp"], want, rtol=1e-5)
    np.testing.assert_allclose(objective, nll + 0.5 * want * count, rtol=1e-5)


def test_the_latent_cache_holds_the_latent_and_the_rope_key_per_token():
    from shard.config.model import cache_bytes_per_token

    # DeepSeek-V3 in bfloat16: 61 layers of 512 + 64 numbers, against 128 heads of keys (192) and values (128)
    assert cache_bytes_per_token(PRESETS["deepseek-v3"], "gpu") == (61 * 576 * 2, 61 * 128 * 320 * 2)
    cache = llama.init_cache(TINY, 1, 10)
    assert {k: v.shape for k, v in cache.items()} == {"ckv": (3, 1, 10, 16), "k_rope": (3, 1, 10, 8)}
    assert sum(v.size * v.dtype.itemsize for v in cache.values()) == 10 * cache_bytes_per_token(TINY, "cpu")[0]


# --- parity with transformers ---------------------------------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
TOKENS = np.random.default_rng(1).integers(0, 256, (8, 16))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A random tiny DeepseekV3ForCausalLM (the tiny twin's dims: MLA with a query latent, a dense first
    layer, then two with 16 experts in 4 groups, top 4 of the best 2 groups, and a shared expert) with weights of std 0.2 and random norm scales,
    saved and read back as shard's config and params."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5, tie_word_embeddings=False,
        initializer_range=0.2, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("deepseek")
    model.save_pretrained(path)
    config_json, tensors = hf.read_hf_dir(str(path))
    ours = hf.config_from_hf(config_json)
    assert dataclasses.replace(ours, name=TINY.name, aux_loss_weight=0.0, compute_dtype="float32", remat="none",
                               router_bias_update=0.0) == dataclasses.replace(TINY, aux_loss_weight=0.0)
    ours = dataclasses.replace(ours, compute_dtype="float32")
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits.numpy()
    return model, path, ours, hf.params_from_hf(tensors, ours), logits


def _logits(cfg, params, mesh, router_bias=None):
    tc = tiny_config(mesh)
    layout = make_layout(tc, parse_mesh(mesh), devices_for(mesh))
    spec = state_spec(cfg, tc.optimizer, 3, layout)

    def f(p, tokens, bias):
        with activation_layout(layout):
            return llama.forward(cfg, p, tokens, router_bias=bias)[0]

    return np.asarray(jax.jit(f)(jax.device_put(params, spec.shardings["params"]), jnp.asarray(TOKENS), router_bias))


@pytest.mark.parametrize("mesh", ["1x1", "ep"])
def test_logits_match_transformers(deepseek, mesh):
    model, _, cfg, params, theirs = deepseek
    ours = _logits(cfg, params, mesh)
    assert np.abs(theirs).max() > 1
    print(f"deepseek_v3 {mesh}: max |logit difference| {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("mesh", ["1x1", "ep"])
def test_greedy_tokens_match_transformers_with_the_latent_cache(deepseek, mesh):
    """On one device and with the experts split over expert=4 (data=2): transformers' greedy tokens."""
    from shard.training.generate import Generator, Sampling

    model, _, cfg, params, _ = deepseek
    prompt = TOKENS[0][:8].tolist()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    tc = tiny_config(mesh)
    layout = make_layout(tc, parse_mesh(mesh), devices_for(mesh))
    spec = state_spec(cfg, tc.optimizer, 3, layout)
    gen = Generator(cfg, spec.graphdef, jax.device_put(params, spec.shardings["params"]), layout, max_len=32)
    tokens = gen.generate(prompt, 24, Sampling(temperature=0))
    assert tokens == theirs[0, len(prompt):].tolist()
    assert len(set(tokens)) > 4


def test_export_reloads_in_transformers_with_identical_tensors(deepseek, tmp_path):
    model, path, cfg, params, _ = deepseek
    hf.write_hf_dir(str(tmp_path), cfg, params, side=path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3" and written["architectures"] == ["DeepseekV3ForCausalLM"]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ref = model.state_dict()
    assert again.state_dict().keys() == ref.keys()
    for name, t in again.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), ref[name].numpy(), err_msg=name)


@pytest.mark.parametrize("change, message", [
    ({"rope_interleave": False}, "rope_interleave=false is not supported"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0, "mscale_all_dim": 1.0}},
     "rope scaling linear with mscale_all_dim is not supported for deepseek_v3"),
])
def test_what_deepseek_cannot_be_is_refused_in_one_line(change, message):
    from shard.errors import ShardError

    with pytest.raises(ShardError, match=message):
        hf.config_from_hf(hf.config_to_hf(TINY) | change)


def test_the_tiny_twin_agrees_across_layouts(deepseek):
    """The loss, the gradient norm and every gradient of the tiny twin (transformers' random weights) on
    fsdp x expert x model (MLA's latent split over fsdp for the weights, its heads over model, the
    experts over expert) are one device's."""
    params = hf.pad_vocab(deepseek[3], TINY)
    ref_loss, ref_grads = loss_and_grads(tiny_config("1x1", model__name="deepseek-v3-tiny"), params)
    loss, grads = loss_and_grads(tiny_config("fsdp=2,expert=2,model=2", model__name="deepseek-v3-tiny"), params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    norm = [float(np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(t)))) for t in (grads, ref_grads)]
    np.testing.assert_allclose(norm[0], norm[1], rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(r))), err_msg=str(path))


# DeepSeek-V3's own long-context settings (its config.json's rope_scaling)
YARN = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def deepseek_checkpoint(deepseek, tmp_path_factory):
    """The tiny model as a real DeepSeek-V3 checkpoint holds it: YaRN (so the softmax scale carries
    mscale(40, 1)^2), a nonzero e_score_correction_bias choosing the experts, and a multi-token prediction
    module stored as layer 3 (its layer, enorm, hnorm, eh_proj, shared_head and the copies of the
    embedding and head), which transformers does not build: added to the saved tensors."""
    from safetensors.numpy import load_file, save_file

    hf_cfg = deepseek[0].config.to_dict() | {"rope_scaling": YARN, "num_nextn_predict_layers": 1,
                                             "max_position_embeddings": 163840}
    hf_cfg.pop("rope_parameters", None)
    model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**hf_cfg)).float().eval()
    rng = np.random.default_rng(3)
    with torch.no_grad():
        model.load_state_dict(deepseek[0].state_dict())
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor(rng.normal(0, 0.5, 16)))
        logits = model(torch.tensor(TOKENS)).logits.numpy()
    path = tmp_path_factory.mktemp("deepseek-yarn")
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    mtp = {k.replace("layers.2.", "layers.3."): v + rng.normal(0, 0.05, v.shape).astype(np.float32)
           for k, v in tensors.items() if k.startswith("model.layers.2.")}
    D = hf_cfg["hidden_size"]
    mtp |= {f"model.layers.3.{n}.weight": (1 + rng.normal(0, 0.3, D)).astype(np.float32)
            for n in ("enorm", "hnorm", "shared_head.norm")}
    mtp |= {"model.layers.3.eh_proj.weight": rng.normal(0, 0.2, (D, 2 * D)).astype(np.float32),
            "model.layers.3.embed_tokens.weight": tensors["model.embed_tokens.weight"],
            "model.layers.3.shared_head.head.weight": tensors["lm_head.weight"]}
    save_file(tensors | mtp, path / "model.safetensors", metadata={"format": "pt"})
    return path, tensors | mtp, logits


def test_a_real_checkpoints_yarn_bias_and_mtp_module_import_with_parity(deepseek_checkpoint):
    from shard.run.weights import load_with_router_bias

    path, tensors, theirs = deepseek_checkpoint
    cfg, params, bias = load_with_router_bias(path)
    assert (cfg.rope_scaling_type, cfg.rope_scaling, cfg.mtp_depth) == ("yarn", 40.0, 1)
    assert cfg.attention_scale == pytest.approx(16 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
    np.testing.assert_array_equal(bias, np.stack([tensors[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
                                                  for i in (1, 2, 3)]))  # the MTP module's layer last
    params = jax.tree.map(np.asarray, params)
    np.testing.assert_array_equal(params["mtp"]["eh_proj"][0], tensors["model.layers.3.eh_proj.weight"].T)
    np.testing.assert_array_equal(params["mtp"]["enorm"][0], tensors["model.layers.3.enorm.weight"])
    np.testing.assert_array_equal(params["mtp"]["layers"]["w_up"][0, 5], tensors["model.layers.3.mlp.experts.5.up_proj.weight"].T)
    ours = _logits(cfg, params, "1x1", jnp.asarray(bias))
    print(f"deepseek_v3 yarn + bias: max |logit difference| {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=2e-5)
    # train --init-from the folder builds the same model (MTP module included) and starts from its bias
    from shard.config.model import ModelConfig
    from shard.run.resume import init_from_base, restore_source

    assert ModelConfig(**init_from_base(str(path))["model"]) == dataclasses.replace(cfg, compute_dtype="auto")
    tc = tiny_config("1x1")
    spec = state_spec(cfg, tc.optimizer, 3, make_layout(tc, parse_mesh("1x1"), devices_for("1x1")))
    started = restore_source(None, False, False, str(path), 0, print)(spec).state
    np.testing.assert_array_equal(np.asarray(started["router_bias"]), bias)
    # the MTP module's layer chooses its experts by its own row of the bias (the last)
    from shard.models import mtp

    def module_out(b):
        h = llama.forward_hidden(cfg, params, jnp.asarray(TOKENS[:2]), router_bias=b)[0]
        return mtp.mtp_hidden(cfg, params, h, jnp.asarray(TOKENS[:2]), router_bias=b)[0][0]

    run = jax.jit(module_out)
    assert np.abs(run(jnp.asarray(bias)) - run(jnp.asarray(bias * np.array([[1], [1], [0]], np.float32)))).max() > 1e-3
    # without the softmax's mscale^2, or without the bias, the logits are another model's
    unscaled = dataclasses.replace(cfg, rope_mscale_all_dim=0.0, rope_mscale=0.0, rope_attention_factor=1.0)
    assert np.abs(_logits(unscaled, params, "1x1", jnp.asarray(bias)) - theirs).max() > 1e-2
    assert np.abs(_logits(cfg, params, "1x1") - theirs).max() > 1e-2


def test_import_then_export_gives_back_every_tensor(deepseek_checkpoint, tmp_path):
    """import-hf writes the bias into the train state and the MTP module among the params; export-hf
    writes both back: every tensor of the folder, equal."""
    from safetensors.numpy import load_file
    from typer.testing import CliRunner

    from shard.cli.app import app

    path, tensors, _ = deepseek_checkpoint
    for args in (["import-hf", str(path), "--out", str(tmp_path / "run")],
                 ["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "back")]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    written = {k: v for f in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(f).items()}
    assert written.keys() == tensors.keys()
    for name, t in tensors.items():
        np.testing.assert_array_equal(written[name], t, err_msg=name)
    config_json = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config_json["num_nextn_predict_layers"] == 1
    assert {k: config_json["rope_parameters"][k] for k in YARN} == YARN


# --- the tiny twin with its multi-token prediction module, trained by Muon, on the test meshes ----------

def _twin_config(mesh: str):
    return tiny_config(mesh, model__name="deepseek-v3-tiny", model__mtp_depth=1, model__router_bias_update=0.01,
                       optimizer__name="muon", optimizer__warmup_steps=0)


def _twin_curves(mesh: str, params: dict) -> dict:
    """Two steps of the tiny twin with one MTP module and auxiliary-loss-free balancing, trained by Muon
    from `params`, on one random batch per step: each step's loss, grad_norm and MTP loss. The train
    step alone (the optimizer's init beside it): the loop's sharded init and run dir would cost this test
    three times its time."""
    from shard.run.weights import state_from
    from shard.testing import random_batch
    from shard.training.step import batch_sharding, make_train_step

    cfg = _twin_config(mesh)
    layout = make_layout(cfg, parse_mesh(mesh), devices_for(mesh))
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    state, step = state_from(params, spec, 0, "init").state, make_train_step(spec, layout)
    curves = {"loss": [], "grad_norm": [], "mtp_loss": []}
    for seed in range(2):
        batch = jax.device_put(random_batch(8, 32, 256, seed), batch_sharding(layout))
        state, metrics = step(state, batch)
        for k in curves:
            curves[k].append(float(metrics[k]))
    return curves


@pytest.fixture(scope="module")
def twin():
    """The twin's initial params (built once: an eager init takes seconds) and its curves on one device."""
    from flax import nnx

    from shard import models

    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(models.build(_twin_config("1x1").model, seed=0))))
    return params, _twin_curves("1x1", params)


@pytest.mark.parametrize("mesh", ["fsdp", "2x4", "ep"])
def test_the_twin_with_mtp_and_muon_agrees_on_every_mesh(twin, mesh):
    """fsdp=8 (weights and MLA's latents split), data=2 x model=4 (heads split) and data=2 x expert=4
    (experts split, tokens exchanged): the losses, gradient norms and MTP losses of one device at rtol
    1e-5, over two Muon steps (the second loss follows the Newton-Schulz update and the moved router bias)."""
    from shard.testing import assert_same_curves

    assert_same_curves(_twin_curves(mesh, twin[0]), twin[1], 1e-5, mesh)
