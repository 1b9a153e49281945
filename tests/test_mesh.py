"""Mesh descriptions: every accepted form, every preset file, and the errors."""

import math

import pytest

from shard.errors import ShardError
from shard.sharding.mesh import build_mesh, parse_mesh, preset_names, resolve_shape


@pytest.mark.parametrize("spec, axes, shape", [
    ("8x4", ("data", "model"), (8, 4)),
    ("8", ("data",), (8,)),
    ("2x2x2", ("data", "fsdp", "model"), (2, 2, 2)),
    ("data=2,fsdp=2,model=2", ("data", "fsdp", "model"), (2, 2, 2)),
    ("fsdp_tp:4x2", ("fsdp", "model"), (4, 2)),
    ("-1x4", ("data", "model"), (-1, 4)),  # -1: the devices there are, as in the other forms
])
def test_forms(spec, axes, shape):
    m = parse_mesh(spec)
    assert (m.axes, m.shape) == (axes, shape)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_fills_eight_devices(name):
    m = parse_mesh(name)
    shape = resolve_shape(m, 8)
    assert len(shape) == len(m.axes) and math.prod(shape) == 8 and all(n >= 1 for n in shape), shape
    assert set(m.rules) >= {"batch", "embed", "heads", "kv_heads", "mlp", "vocab", "layers"}


def test_presets_fill_the_devices():
    assert resolve_shape(parse_mesh("fsdp"), 8) == (8,)
    assert resolve_shape(parse_mesh("fsdp_tp"), 8) == (4, 2)
    assert resolve_shape(parse_mesh("dp"), 32) == (32,)


def test_fsdp_preset_shards_params_on_embed_only():
    m = parse_mesh("fsdp")
    assert m.param_rules["embed"] == ("fsdp",) and m.rules["embed"] == ()


def test_build_mesh_names_axes():
    import jax

    mesh = build_mesh(parse_mesh("2x4"), jax.devices())
    assert dict(mesh.shape) == {"data": 2, "model": 4}


@pytest.mark.parametrize("spec, message", [
    ("foo=8", "unknown mesh axis 'foo'"),
    ("nonesuch", "unknown mesh 'nonesuch'"),
    ("data=x", "must be an integer"),
    ("data=2,data=4", "named twice"),
    ("1x2x3x4", "1 to 3 dimensions"),
    ("fsdp_tp:8", "has 1 sizes for 2 axes"),
    ("fsdp_tp:data=2,model=2", r"after ':' must be a shape like 4x2 \(the preset names its axes: fsdp, model\)"),
    ("0x8", "must be positive"),
    ("-1x-1", r"one may be -1 to fill the devices\), got \[-1, -1\]"),
    ("data=-1,model=-1", r"one may be -1 to fill the devices"),
])
def test_bad_specs(spec, message):
    with pytest.raises(ShardError, match=message):
        parse_mesh(spec)


def test_size_mismatch_says_how_many_exist_and_how_to_simulate():
    with pytest.raises(ShardError, match=r"needs 32 devices but 8 exist.*--simulate-devices 32"):
        resolve_shape(parse_mesh("8x4"), 8)


def test_fill_that_cannot_divide():
    with pytest.raises(ShardError, match="cannot fill 7 devices"):
        resolve_shape(parse_mesh("fsdp_tp"), 7)


def test_preset_file_with_unknown_key(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('axes = ["data"]\nshpe = [2]\n')
    with pytest.raises(ShardError, match="unknown key"):
        parse_mesh(str(p))


def test_preset_file_whose_axes_are_not_a_list(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('axes = "data"\n')
    with pytest.raises(ShardError, match=r"axes must be a list of names, like \["):
        parse_mesh(str(p))


def test_a_mesh_file_shape_of_booleans_is_refused(tmp_path):
    """TOML's true passed as a size of 1 (bool is an int in Python)."""
    f = tmp_path / "m.toml"
    f.write_text('axes = ["data"]\nshape = [true]\n')
    with pytest.raises(ShardError, match=r"shape must be a list of integers, got \[True\]"):
        parse_mesh(str(f))


def test_a_mesh_file_without_a_shape_fills_its_first_axis(tmp_path):
    from shard.sharding.mesh import load_preset

    f = tmp_path / "m.toml"
    f.write_text('axes = ["data", "model"]\n')
    assert resolve_shape(load_preset(str(f)), 8) == (8, 1)


def test_a_mesh_file_is_read_as_a_file_whatever_its_folder_is_called(tmp_path):
    """Saved absolute, a mesh file's path may hold '=' or ':' (a folder `lr=3e-4`): it was read as
    axes (`size of axis '/tmp/lr' must be an integer`) or as a preset and a shape."""
    from shard.sharding.mesh import split_mesh_file
    from shard.run.run_dir import mesh_label

    folder = tmp_path / "lr=3e-4" / "t10:00"
    folder.mkdir(parents=True)
    (folder / "m.toml").write_text('axes = ["data", "model"]\n')
    assert parse_mesh(str(folder / "m.toml")).axes == ("data", "model")
    assert parse_mesh(f"{folder / 'm.toml'}:4x2").shape == (4, 2)
    assert split_mesh_file(f"{folder / 'm.toml'}:4x2") == (str(folder / "m.toml"), "4x2")
    assert split_mesh_file("fsdp_tp:4x2") is None and split_mesh_file("data=2,model=4") is None
    assert mesh_label(f"{folder / 'm.toml'}:4x2") == "m_4x2"
