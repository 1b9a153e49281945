"""Rules place every parameter where they say; inspect's bytes are the real shards' bytes."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shard.errors import ShardError
from shard.measure.inspection import summary
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh
from shard.sharding.rules import Layout, logical_axes_of, param_shardings, path_str
from shard.training.state import init_state, state_spec
from shard.testing import devices_for, fake_mesh, tiny_config


@pytest.fixture(scope="module", params=["fsdp_tp:4x2", "2x4"])
def initialised(request):
    cfg = tiny_config(request.param, model__tie_embeddings=False)
    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices_for(cfg.mesh.spec))
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    return request.param, layout, spec, init_state(spec, cfg.model, cfg.seed)


def test_each_parameter_is_sharded_as_its_rule_says(initialised):
    _, layout, spec, state = initialised
    flat_axes = {path_str(p): a for p, a in
                 jax.tree_util.tree_flatten_with_path(spec.logical, is_leaf=lambda x: isinstance(x, tuple))[0]}
    for path, arr in jax.tree_util.tree_flatten_with_path(state["params"])[0]:
        expected = layout.spec(flat_axes[path_str(path)], param=True)
        assert arr.sharding.spec == expected, path_str(path)


def test_known_placements(initialised):
    mesh, _, _, state = initialised
    p = state["params"]
    if mesh == "fsdp_tp:4x2":  # FSDP on embed for weights, Megatron TP on heads and mlp
        assert p["layers"]["wq"].sharding.spec == P(None, "fsdp", "model", None)
        assert p["layers"]["w_down"].sharding.spec == P(None, "model", "fsdp")
        assert p["embed"].sharding.spec == P("model", "fsdp")
    else:  # data x model: weights replicated over data
        assert p["layers"]["wq"].sharding.spec == P(None, None, "model", None)
        assert p["final_norm"].sharding.spec == P(None)


def test_optimizer_state_follows_its_parameter(initialised):
    _, _, _, state = initialised
    adam = state["opt_state"][1][0]
    assert adam.mu["layers"]["wq"].sharding == state["params"]["layers"]["wq"].sharding
    assert adam.nu["unembed"].sharding == state["params"]["unembed"].sharding


def test_inspect_bytes_equal_the_real_shards(initialised):
    _, layout, spec, state = initialised
    doc = summary(spec, layout)
    device = layout.mesh.devices.flat[0]
    real = {path_str(p): sum(s.data.nbytes for s in a.addressable_shards if s.device == device)
            for p, a in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
    for row in doc["params"]:
        assert row["bytes_per_device"] == real[row["name"]], row["name"]
    assert doc["params_bytes_per_device"] == sum(real.values())
    opt_real = sum(sum(s.data.nbytes for s in a.addressable_shards if s.device == device)
                   for a in jax.tree.leaves(state["opt_state"]))
    assert doc["opt_state_bytes_per_device"] == opt_real


def test_init_is_bit_identical_to_an_unsharded_init():
    cfg = tiny_config("fsdp_tp:4x2")
    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices_for(cfg.mesh.spec))
    sharded = init_state(state_spec(cfg.model, cfg.optimizer, 3, layout), cfg.model, 0)["params"]
    one = make_layout(cfg, parse_mesh("1x1"), devices_for("1x1"))
    single = init_state(state_spec(cfg.model, cfg.optimizer, 3, one), cfg.model, 0)["params"]
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class Unannotated(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(16, 32, rngs=rngs)
        self.out = nnx.Linear(32, 16, use_bias=False, rngs=rngs)


def _layout(mesh="2x4", **kw):
    spec = parse_mesh(mesh)
    return Layout(fake_mesh(mesh), spec.rules, spec.param_rules, **kw)


def test_regex_rules_shard_an_unannotated_model():
    state = nnx.state(nnx.eval_shape(lambda: Unannotated(nnx.Rngs(0))))
    regex = (("proj/kernel", ("embed", "mlp")), ("proj/bias", ("mlp",)), ("out/.*", ("mlp", "embed")))
    logical = logical_axes_of(state, regex)
    shardings = param_shardings(nnx.to_pure_dict(state), logical, _layout(regex_rules=regex))
    assert shardings["proj"]["kernel"].spec == P(None, "model")
    assert shardings["out"]["kernel"].spec == P("model", None)


def test_unannotated_parameter_without_a_rule_is_an_error():
    state = nnx.state(nnx.eval_shape(lambda: Unannotated(nnx.Rngs(0))))
    with pytest.raises(ShardError, match="without logical axes.*out/kernel"):
        logical_axes_of(state, (("proj/kernel", ("embed", "mlp")), ("proj/bias", ("mlp",))))


@pytest.mark.parametrize("pattern, why", [
    ("proj/kernal", r"matches no parameter \(a full match of paths such as \w+/\w+; `shard inspect` lists them\)"),
    ("proj/.*", r"decides no parameter: an earlier pattern matches proj/\w+ first"),
])
def test_a_regex_rule_that_decides_no_parameter_is_an_error(pattern, why):
    """A typo in a pattern (or one an earlier pattern shadows) changed nothing, silently."""
    state = nnx.state(nnx.eval_shape(lambda: Unannotated(nnx.Rngs(0))))
    regex = (("proj/kernel", ("embed", "mlp")), ("proj/bias", ("mlp",)), ("out/.*", ("mlp", "embed")),
             (pattern, ("embed", "mlp")))
    with pytest.raises(ShardError, match=rf"param_regex '{re.escape(pattern)}' {why}"):
        logical_axes_of(state, regex)


def test_a_regex_rule_for_annotated_parameters_is_an_error_naming_param_rules():
    cfg = tiny_config("2x4")
    layout = make_layout(cfg, parse_mesh("2x4"), devices_for("2x4"))
    layout = dataclasses.replace(layout, regex_rules=(("layers/w.", ("layers", "mlp", "embed")),))
    with pytest.raises(ShardError, match=r"param_regex 'layers/w.' decides no parameter: layers/w\w and \d+ more "
                                         r"carry logical axes of their own, which win over it; param_rules"):
        state_spec(cfg.model, cfg.optimizer, 3, layout)


def test_non_dividing_dimension_names_parameter_axis_and_sizes():
    cfg = tiny_config("1x8", model__mlp_dim=100)
    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices_for(cfg.mesh.spec))
    with pytest.raises(ShardError, match=r"parameter layers/w_down \(2, 100, 64\): dimension 1 \(mlp\) of size 100 .*model=8"):
        state_spec(cfg.model, cfg.optimizer, 3, layout)


def test_one_mesh_axis_on_two_dimensions_is_an_error():
    layout = _layout()
    with pytest.raises(ShardError, match="used by both 'heads' and 'mlp'"):
        layout.spec(("heads", "mlp"))


@pytest.mark.parametrize("rule, message", [
    ({"batch": ("model",)}, "'model' is used by both 'batch' and 'heads'"),
    ({"length": ("model",)}, "'model' is used by both 'length' and 'heads'"),
    ({"head_dim": ("data",)}, "'data' is used by both 'batch' and 'head_dim'"),
    ({"embed": ("model",)}, "'model' is used by both 'vocab' and 'embed'"),  # the cast embedding table
])
def test_rules_that_no_activation_can_take_are_refused_with_the_layout(rule, message):
    """Checked where the layout is built (inspect, plan's check, train), not first when the step traces."""
    cfg = tiny_config("2x4")
    with pytest.raises(ShardError, match=f"activation: mesh axis {message}"):
        make_layout(dataclasses.replace(cfg, rules=cfg.rules | rule), parse_mesh("2x4"), devices_for("2x4"))


def test_a_misspelt_mesh_axis_in_a_rule_is_an_error_and_a_bare_name_is_one_axis():
    """From Python, {"mlp": ("modle",)} replicated the MLP in silence, and {"mlp": "model"} read each
    letter as an axis."""
    layout = _layout()
    with pytest.raises(ShardError, match="rules: 'mlp' maps to 'modle', which is not a mesh axis"):
        Layout(layout.mesh, dict(layout.rules) | {"mlp": ("modle",)})
    with pytest.raises(ShardError, match="param_rules: 'embed' maps to 'fdsp'"):
        Layout(layout.mesh, layout.rules, param_rules={"embed": ("fdsp",)})
    bare = Layout(layout.mesh, dict(layout.rules) | {"mlp": "model"})
    assert bare.spec(("embed", "mlp")) == P(None, "model")


def test_logical_axis_without_rule_is_an_error():
    with pytest.raises(ShardError, match="logical axis 'experts' has no rule"):
        _layout().spec(("experts",))


def test_optimizer_leaves_take_a_parameters_sharding_only_with_its_shape():
    """A factored moment (Adafactor's row statistics) sits at the parameter's path with another shape:
    it took the parameter's 2-D sharding, which can't apply to it."""
    from jax.sharding import NamedSharding

    from shard.sharding.rules import like_params

    mesh = fake_mesh("2x4")
    sds = jax.ShapeDtypeStruct
    params = {"w": sds((8, 16), np.float32)}
    split = {"w": NamedSharding(mesh, P("data", "model"))}
    # (moment, row statistics, count), as an optax state's fields hold them
    opt = ({"w": sds((8, 16), np.float32)}, {"w": sds((8,), np.float32)}, sds((), np.int32))
    mu, v_row, count = like_params(opt, params, split, mesh)
    assert mu["w"].spec == P("data", "model")
    assert v_row["w"].spec == P() and count.spec == P()
