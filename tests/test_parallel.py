"""Pipeline, context, sequence and expert parallelism compute what the plain model computes (fp32):
same loss, same gradients; plus the pieces (schedules, ring attention, routing) and the errors."""

import dataclasses
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from shard.measure.flops import scored_keys
from shard.errors import ShardError
from shard.training.step import check_batch
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh
from shard.models import moe
from shard.config.presets import PRESETS
from shard.parallel import schedule as sched
from shard.parallel.ring_attention import ring_attention, zigzag_positions
from shard.testing import fake_mesh, loss_and_grads, tiny_config

RTOL = 1e-5


def assert_same(out, ref):
    """Same loss (rtol 1e-5) and gradients: every leaf within 1e-5 of its largest entry."""
    np.testing.assert_allclose(out[0], ref[0], rtol=RTOL)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(out[1])[0], jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=RTOL * float(np.max(np.abs(r))), err_msg=str(path))


# --- pipeline ------------------------------------------------------------------------------------------

PIPE = dict(model__n_layers=4, data__batch=16)


@pytest.fixture(scope="module")
def dense_reference():
    return loss_and_grads(tiny_config("1x1", **PIPE))


# Packed rows (two documents a row, padding) and the loss in chunks of 8 positions (4 a row), 8 layers so
# that interleaved V = 2 runs on 4 stages: one reference for every schedule's packed case.
PACKED = dict(PIPE, model__n_layers=8, model__loss_chunk=8)


@pytest.fixture(scope="module")
def packed_reference():
    return loss_and_grads(tiny_config("1x1", **PACKED), packed=True)


@pytest.mark.parametrize("mesh, schedule, packed", [
    ("stage=2,data=2,model=2", "gpipe", True),
    ("stage=2,data=4", "1f1b", False),
    ("stage=2,data=2,model=2", "1f1b", True),
    ("stage=2,data=2,fsdp=2", "gpipe", False),  # data manual in the schedule, fsdp left to the partitioner
    ("stage=4,fsdp=2", "1f1b", False),
])
def test_pipeline_matches_the_unpipelined_model(mesh, schedule, packed, request):
    """Packed cases: the segment ids and positions ride beside the chain, and the last stage's head
    computes the loss in chunks."""
    sets, ref = (PACKED, "packed_reference") if packed else (PIPE, "dense_reference")
    cfg = tiny_config(mesh, **sets, pipeline__schedule=schedule, pipeline__microbatches=4)
    *out, hlo = loss_and_grads(cfg, with_hlo=True, packed=packed)
    assert_same(out, request.getfixturevalue(ref))
    if schedule == "1f1b":  # it passes on what its table sends, no more (stage=4: five distinct pair sets)
        S = int(re.search(r"stage=(\d+)", mesh).group(1))
        table = {p for tick in sched.build("1f1b", S, 4).sends() for p in tick if p}
        assert stage_pair_sets(hlo, S) == table


def stage_pair_sets(hlo: str, S: int) -> set[tuple[tuple[int, int], ...]]:
    """The stage pairs of each collective-permute over `stage` alone in compiled HLO (stage outermost in
    the mesh, as shard orders it: device d on stage d // (8 // S))."""
    inner, out = 8 // S, set()
    for m in re.finditer(r"collective-permute(?:-start)?\(.*?source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", hlo):
        pairs = [tuple(map(int, p.split(","))) for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))]
        if all(a % inner == b % inner for a, b in pairs):
            out.add(tuple(sorted({(a // inner, b // inner) for a, b in pairs})))
    return out


@pytest.mark.parametrize("mesh, schedule, virtual", [
    ("stage=2,data=2,model=2", "interleaved", 2),
    ("stage=4,data=2", "interleaved", 2),
    ("stage=2,data=2,model=2", "zero_bubble", 1),
    ("stage=4,data=2", "zero_bubble", 1),
])
def test_interleaved_and_zero_bubble_match_the_unpipelined_model(mesh, schedule, virtual, packed_reference):
    """Interleaved: V = 2 chunks a stage, layer block v = c S + s on stage s (stage=4: 8 chunks of a
    layer). Zero-bubble: the backward split into B (input gradient) and W (layers' gradient, run in the
    bubbles; 2 layers a stage). With packed rows and the loss in chunks on the last stage, the loss and
    every gradient as one device's."""
    assert_same(loss_and_grads(tiny_config(mesh, **PACKED, pipeline__schedule=schedule, pipeline__virtual_stages=virtual,
                                           pipeline__microbatches=4), packed=True), packed_reference)


def test_zero_bubbles_w_runs_the_weight_matmuls_alone():
    """The chunk's pullback split in two: B's body has the input-gradient chain, W's only the weight
    gradients' matmuls (tiny: q/k/v, o, gate/up, down), so B and W together do what one backward does,
    and nothing twice."""
    from flax import nnx

    from shard import models
    from shard.models import llama
    from shard.parallel import zero_bubble

    cfg = tiny_config("1x1", model__n_layers=2).model
    layers = nnx.to_pure_dict(nnx.state(models.build(cfg, seed=0)))["layers"]
    x = jnp.zeros((2, 32, cfg.d_model))
    plan = zero_bubble.plan(lambda lp, x: llama.run_layers(cfg, lp, x)[0], layers, x)
    dots = lambda closed: sum(e.primitive.name == "dot_general" for e in closed.jaxpr.eqns)  # noqa: E731
    _, pull = jax.vjp(lambda lp, x: llama.run_layers(cfg, lp, x)[0], layers, x)
    backward = jax.make_jaxpr(pull)(x).eqns[0].params["jaxpr"]  # one reverse scan over the layers
    assert (dots(plan.w_body), dots(plan.b_body) + dots(plan.w_body)) == (4, dots(backward))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gemma_layers_keep_their_kind_in_a_pipeline(schedule):
    """Gemma's local and global layers alternate by layer index: each stage numbers its slice from its own
    first layer (stage=4: one layer a stage, local, global, local, global), as the unpipelined model."""
    gemma = dict(PIPE, model__name="gemma3-tiny")
    assert_same(loss_and_grads(tiny_config("stage=4,data=2", **gemma, pipeline__schedule=schedule,
                                           pipeline__microbatches=4)), loss_and_grads(tiny_config("1x1", **gemma)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("mesh, dtype", [("stage=2,model=4", "compute"), ("stage=2,data=2,model=2", "param")])
def test_a_bfloat16_pipeline_with_tensor_parallel_compiles_and_matches(schedule, mesh, dtype):
    """bfloat16 activations summed over `stage` (and bfloat16 weight gradients over the manual `data`)
    with an automatic axis beside them aborted XLA:CPU (AllReducePromotion, "Invalid binary instruction
    opcode copy"): those sums now run in float32 there. Loss and gradients as the unpipelined model's,
    to bfloat16's precision."""
    bf16 = dict(PIPE, **{f"model__{dtype}_dtype": "bfloat16"})
    ref = loss_and_grads(tiny_config("1x1", **bf16))
    out = loss_and_grads(tiny_config(mesh, **bf16, pipeline__schedule=schedule))
    np.testing.assert_allclose(out[0], ref[0], rtol=2e-3)
    for g, r in zip(jax.tree.leaves(out[1]), jax.tree.leaves(ref[1])):
        r = np.asarray(r, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), r, atol=0.05 * float(np.max(np.abs(r))))


def test_1f1b_with_kv_heads_replicated_under_tensor_parallel():
    """What the divisibility error suggests for GQA under tensor parallel (`rules.kv_heads=none`): the
    fused q/k/v weight was regrouped across devices by collective permutes inside 1F1B's per-stage
    branches, and the step aborted in a deadlock ("only 4 of 8 threads arrived"). Now q, k and v take
    three einsums there, and the step matches the unpipelined model."""
    gqa = dict(PIPE, model__n_kv_heads=2)
    ref = loss_and_grads(tiny_config("1x1", **gqa))
    out = loss_and_grads(tiny_config("stage=2,model=4", **gqa, rules__kv_heads="none",
                                     pipeline__schedule="1f1b", pipeline__microbatches=4))
    assert_same(out, ref)


def test_pipeline_gradients_are_not_trivially_equal(dense_reference):
    # Guards the comparison: every layer's gradient is nonzero, so a stage that did nothing would show.
    for g in jax.tree.leaves(dense_reference[1]["layers"]):
        assert np.all(np.abs(g).reshape(g.shape[0], -1).max(axis=1) > 0)


@pytest.mark.parametrize("stages, micro", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 32)])
def test_schedules_have_the_formula_bubble_and_1f1b_memory_is_flat(stages, micro):
    """Bubble by schedule (the table's idle slots) == bubble by formula, for every schedule; each stage
    runs every (microbatch, chunk)'s phases once; 1F1B and zero-bubble keep at most S inputs."""
    for kind in sched.SCHEDULES:
        V = 2 if kind == "interleaved" else 1
        sch = sched.build(kind, stages, micro, V)
        assert sch.idle_fraction() == pytest.approx(sched.bubble_formula(kind, stages, micro, V)), kind
        sends = sch.sends()  # the minimum: each microbatch crosses each boundary once each way
        assert [sum(len(tick[i]) for tick in sends) for i in (0, 1)] == [micro * (V * stages - 1)] * 2, kind
        phases = (sched.FWD, sched.BWD) + ((sched.WGT,) if kind == "zero_bubble" else ())
        for s in range(stages):
            rows = sch.table[sch.table[:, 1] == s]
            for phase in phases:
                assert sorted(map(tuple, rows[rows[:, 4] == phase][:, 2:4])) == [
                    (m, c) for m in range(micro) for c in range(V)], (kind, s, phase)
    # 1F1B and ZB-H1 keep at most `stages` inputs per stage whatever the microbatch count; GPipe keeps all.
    assert max(sched.build("zero_bubble", stages, micro).held()) <= stages
    assert sched.w_slots(sched.build("zero_bubble", stages, micro)) == stages  # W's waiting on the last stage
    assert sched.slots(sched.build("1f1b", stages, micro)) <= stages
    assert sched.slots(sched.build("gpipe", stages, micro)) == micro


def test_the_schedule_chart_draws_the_table():
    """`shard inspect` draws the table: stages x ticks, F/B/W per op, . where idle (1F1B, S=2, M=3)."""
    assert sched.build("1f1b", 2, 3).chart() == "stage 0 FF.BFB.B\nstage 1 .FBFBFB."
    assert sched.build("zero_bubble", 2, 2).chart() == "stage 0 FF.BWBW\nstage 1 .FBFBWW"


# --- context and sequence parallel ---------------------------------------------------------------------


def _qkv(seq_len=256):
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    return (jax.random.normal(kq, (2, seq_len, 4, 16)), jax.random.normal(kk, (2, seq_len, 2, 16)),
            jax.random.normal(kv, (2, seq_len, 2, 16)))


@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_matches_full_attention(causal):
    mesh = fake_mesh("data=2,context=4")
    q, k, v = _qkv()
    got = jax.jit(lambda q, k, v: ring_attention(q, k, v, ("context",), causal=causal, mesh=mesh))(q, k, v)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mesh, n", [("data=2,context=4", 4), ("context=8", 8), ("data=4,context=2", 2)])
def test_the_load_balanced_ring_matches_full_attention_and_its_gradients(mesh, n):
    """The zig-zag order in, the same order out: full causal attention, permuted; and its gradients."""
    mesh = fake_mesh(mesh)
    q, k, v = _qkv()
    order = zigzag_positions(256, n)
    h = 256 // (2 * n)  # device 0 holds the first chunk and the last
    assert sorted(order) == list(range(256)) and list(order[:2 * h]) == [*range(h), *range(256 - h, 256)]

    def balanced(q, k, v):
        return ring_attention(q[:, order], k[:, order], v[:, order], ("context",), zigzag=True, mesh=mesh)

    def full(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)[:, order]

    np.testing.assert_allclose(jax.jit(balanced)(q, k, v), full(q, k, v), atol=2e-5, rtol=2e-5)
    weigh = jax.random.normal(jax.random.key(4), q[:, order].shape)  # a loss that weighs every output
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * weigh), argnums=(0, 1, 2)))(q, k, v)
             for f in (balanced, full)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def _attention_flops(jaxpr) -> float:
    """FLOPs of the dot products in a jaxpr, a scanned body counted once per iteration."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * np.prod(eqn.outvars[0].aval.shape) * np.prod([lhs[d] for d in contract])
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += times * _attention_flops(sub)
    return total


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_load_balanced_ring_scores_2c_plus_1_over_4c_of_the_keys(n):
    """Three chunk pairs of its own block's four and half of every other block: (2n + 1) / 4n of the
    plain ring's work on every device, which is what scored_keys counts."""
    mesh = fake_mesh(f"context={n}")
    q, k, v = _qkv()
    flops = {zigzag: _attention_flops(jax.make_jaxpr(
        lambda q, k, v, z=zigzag: ring_attention(q, k, v, ("context",), zigzag=z, mesh=mesh))(q, k, v).jaxpr)
        for zigzag in (False, True)}
    assert flops[True] / flops[False] == pytest.approx((2 * n + 1) / (4 * n))
    assert scored_keys(PRESETS["tiny"], 256, n) / 256 == pytest.approx((2 * n + 1) / (4 * n))


def _dot_products(jaxpr) -> list:
    return [e for e in jaxpr.eqns if e.primitive.name == "dot_general"] + [
        d for e in jaxpr.eqns for sub in jax.extend.core.jaxprs_in_params(e.params) for d in _dot_products(sub)]


@pytest.mark.parametrize("zigzag", [False, True])
def test_the_rings_matmuls_take_bf16_and_accumulate_in_float32(zigzag):
    """As flash attention does: bf16 inputs run at the tensor cores' full rate (float32 ran as TF32)."""
    mesh = fake_mesh("data=2,context=4")
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
    order = zigzag_positions(256, 4) if zigzag else np.arange(256)

    def ring(q, k, v):
        return ring_attention(q, k, v, ("context",), zigzag=zigzag, mesh=mesh)

    dots = _dot_products(jax.make_jaxpr(ring)(q, k, v).jaxpr)
    assert dots and all(e.invars[0].aval.dtype == e.invars[1].aval.dtype == jnp.bfloat16
                        and e.outvars[0].aval.dtype == jnp.float32 for e in dots)
    got = jax.jit(ring)(q[:, order], k[:, order], v[:, order])
    want = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)[:, order]
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=1e-2)  # bf16 rounds the output by up to 7e-3


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(tiny_config("1x1"))


def test_context_parallel_matches_and_passes_kv_round_a_ring(reference):
    loss, grads, hlo = loss_and_grads(tiny_config("cp"), with_hlo=True)
    assert_same((loss, grads), reference)
    assert "collective-permute" in hlo


def test_sequence_parallel_matches(reference):
    assert_same(loss_and_grads(tiny_config("sp")), reference)


# --- FSDP embedding lookup ----------------------------------------------------------------------------


def _table_sized_all_reduces(hlo: str, rows: int, dim: int) -> int:
    return sum(line.split(" all-reduce(")[0].count(f"f32[{rows},{dim}]") for line in hlo.splitlines()
               if " all-reduce(" in line)


def test_fsdp_with_a_large_vocab_looks_up_in_the_stored_table():
    """More table rows than tokens: every device looks up the ids in its slice of the embed dim instead
    of a gathered table. Same loss and gradients as one device, and only the logits' gradient is
    reduced at table size (the lookup's gradient stays in each device's slice)."""
    kw = dict(model__vocab_size=4096)
    loss, grads, hlo = loss_and_grads(tiny_config("fsdp", **kw), with_hlo=True)
    assert_same((loss, grads), loss_and_grads(tiny_config("1x1", **kw)))
    assert _table_sized_all_reduces(hlo, 4096, 64) == 1
    # a small vocab (fewer rows than tokens) keeps the gathered table: two table-sized reductions
    assert _table_sized_all_reduces(loss_and_grads(tiny_config("fsdp"), with_hlo=True)[2], 256, 64) == 2


# --- mixture of experts --------------------------------------------------------------------------------


def test_expert_parallel_matches_replicated_experts_and_dispatches_by_all_to_all():
    ref = loss_and_grads(tiny_config("1x1", model__name="moe-tiny"))
    loss, grads, hlo = loss_and_grads(tiny_config("ep", model__name="moe-tiny"), with_hlo=True)
    assert_same((loss, grads), ref)
    assert "all-to-all" in hlo


def test_routing_respects_capacity():
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (4, 64, 8)) * 3, axis=-1)
    over = under = False
    for k, factor in ((1, 1.0), (2, 1.25), (2, 0.5)):
        cap = dataclasses.replace(PRESETS["moe-tiny"], experts_per_token=k, capacity_factor=factor).expert_capacity(64)
        dispatch, combine, _ = moe.route(probs, k, cap)
        per_slot = dispatch.sum(axis=1)  # (B, E, C): tokens in each slot
        assert float(per_slot.max()) == 1.0  # a slot holds one token
        assert float(dispatch.sum(axis=(1, 3)).max()) <= cap  # an expert takes at most its capacity
        assert float(dispatch.sum(axis=(2, 3)).max()) <= k  # a token goes to at most k experts
        kept = combine.sum(axis=(2, 3))  # gates of kept tokens sum to at most 1
        assert float(kept.max()) <= 1.0 + 1e-6
        # each expert keeps exactly min(load, capacity) of the tokens choosing it, in every sequence
        chosen = np.argsort(-np.asarray(probs), axis=-1)[..., :k]  # (B, T, k)
        load = (chosen[..., None] == np.arange(8)).sum(axis=(1, 2))  # (B, E)
        np.testing.assert_array_equal(np.asarray(dispatch.sum(axis=(1, 3))), np.minimum(load, cap))
        over, under = over or (load > cap).any(), under or (load < cap).any()
    assert over and under  # experts over and under their capacity were both tried
    # With room for everyone, every token reaches its k experts.
    dispatch, _, _ = moe.route(probs, 2, 64 * 2)
    assert float(dispatch.sum()) == 4 * 64 * 2


def test_load_balancing_loss_falls_under_training():
    h = jax.random.normal(jax.random.key(1), (4, 64, 16))
    router = jnp.zeros((16, 8)).at[:, 0].set(1.0)  # everything prefers expert 0 at first

    def aux_loss(r):
        return moe.route(moe.router_probs(h, r), 2, PRESETS["moe-tiny"].expert_capacity(64))[2]

    grad = jax.jit(jax.value_and_grad(aux_loss))
    first, _ = grad(router)
    for _ in range(30):
        _, g = grad(router)
        router = router - 0.5 * g
    assert float(aux_loss(router)) < 0.8 * float(first)


# --- bad input -----------------------------------------------------------------------------------------


def _check(mesh: str, **sets):
    cfg = tiny_config(mesh, **sets)
    check_batch(cfg, make_layout(cfg, parse_mesh(mesh), jax.devices()[:8]))


@pytest.mark.parametrize("mesh, sets, message", [
    ("stage=4,data=2", {}, r"2 layers do not split into 4 stages"),
    ("stage=2,data=4", {"data__batch": 16, "pipeline__microbatches": 3}, r"does not split into pipeline.microbatches=3"),
    ("stage=2,data=4", {"model__n_layers": 4, "pipeline__schedule": "interleaved", "pipeline__virtual_stages": 4},
     r"4 layers do not split into 2 stages x 4 virtual stages"),
    ("stage=4,data=2", {"model__n_layers": 8, "data__batch": 12, "pipeline__schedule": "interleaved",
                        "pipeline__virtual_stages": 2, "pipeline__microbatches": 6},
     r"interleaved schedule runs microbatches in groups of the 4 stages; pipeline.microbatches=6 is not"),
    ("stage=2,data=4", {"data__batch": 16, "pipeline__virtual_stages": 2},
     r"pipeline.virtual_stages=2 needs pipeline.schedule=interleaved \(got 1f1b\)"),
    ("cp", {"data__seq_len": 30}, r"sequence length 30 does not divide over 4 devices \(context=4"),
    ("ep", {"model__name": "moe-tiny", "model__n_experts": 6}, r"6 experts do not divide over the expert axis"),
    # it crashed in Shardy's verifier with a traceback (ring attention's shard_map nested in the stages')
    ("stage=2,context=4", {}, r"context parallelism \(ring attention over `length`\) does not run inside"),
    # XLA's partitioner aborted the process (a failed check, no Python error) on this mesh with 1F1B
    ("stage=2,fsdp=2,model=2", {"data__batch": 8}, r"pipeline.schedule=1f1b with both fsdp and model axes beside"),
])
def test_bad_layouts_are_clear_errors(mesh, sets, message):
    with pytest.raises(ShardError, match=message):
        _check(mesh, **sets)


def test_unknown_schedule_is_an_error():
    with pytest.raises(ShardError, match="pipeline.schedule must be one of gpipe, 1f1b, interleaved, zero_bubble"):
        tiny_config("pipeline", pipeline__schedule="zigzag")


def test_moe_preset_counts_experts():
    cfg = PRESETS["moe-tiny"]
    dense = dataclasses.replace(cfg, n_experts=0)
    assert cfg.num_params() - dense.num_params() == cfg.n_layers * (7 * 3 * 64 * 64 + 64 * 8)
