"""Mesh descriptions: parse `8x4`, `data=2,fsdp=2,model=2` or a preset name into axes, shape and rules.

Parsing is pure Python (the CLI needs the device count before JAX starts); only `build_mesh` imports JAX.
"""

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from shard.axes import DATA, FSDP, MODEL
from shard import tomlfiles
from shard.config.rules import check_axes, parse_rules
from shard.errors import ShardError

# Axis names for a bare shape such as `8x4`, by its number of dimensions.
AXES_FOR_BARE_SHAPE = {1: (DATA,), 2: (DATA, MODEL), 3: (DATA, FSDP, MODEL)}
FILL = -1  # a shape entry that takes whatever devices the other axes leave

_PRESET_KEYS = {"description", "axes", "shape", "rules", "param_rules"}
_BARE_SHAPE = re.compile(r"^-?\d+(x-?\d+)*$")  # one size may be -1: the devices there are


@dataclass(frozen=True)
class MeshSpec:
    """What `--mesh` asked for: axis names, sizes (FILL allowed once) and the rules that go with them."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]
    rules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    param_rules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    source: str = ""

    def describe(self, shape: tuple[int, ...] | None = None) -> str:
        sizes = shape or self.shape
        return ",".join(f"{a}={'*' if s == FILL else s}" for a, s in zip(self.axes, sizes))


def preset_names() -> list[str]:
    return sorted(p.name[: -len(".toml")] for p in _presets_dir().iterdir() if p.name.endswith(".toml"))


def _presets_dir():
    return resources.files("shard.meshes")


def _check_shape(shape, n_axes: int, where: str) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise ShardError(f"{where}: shape must be a list of integers, got {shape!r}")
    if len(shape) != n_axes:
        raise ShardError(f"{where}: shape {list(shape)} has {len(shape)} sizes for {n_axes} axes")
    if any(s == 0 or s < FILL for s in shape) or list(shape).count(FILL) > 1:
        raise ShardError(f"{where}: sizes must be positive (one may be -1 to fill the devices), got {list(shape)}")
    return tuple(shape)


def load_preset(name_or_path: str) -> MeshSpec:
    """A preset from shard/meshes/ by name, or any TOML file of the same form; default rules underneath."""
    base = tomlfiles.read(_presets_dir().joinpath("default.toml"), "mesh preset file default")
    if name_or_path.endswith(".toml"):
        path, label = Path(name_or_path), name_or_path
        doc = tomlfiles.read(path, f"mesh preset file {label}")
    else:
        if name_or_path not in preset_names():
            raise ShardError(
                f"unknown mesh {name_or_path!r}: give a shape like 8x4, axes like data=2,model=4, "
                f"or a preset ({', '.join(preset_names())})"
            )
        label = name_or_path
        doc = tomlfiles.read(_presets_dir().joinpath(f"{name_or_path}.toml"), f"mesh preset file {label}")
    unknown = set(doc) - _PRESET_KEYS
    if unknown:
        raise ShardError(f"mesh preset {label}: unknown key(s) {', '.join(sorted(unknown))}")
    axes = doc.get("axes", ())
    if not isinstance(axes, list) or not all(isinstance(a, str) for a in axes):
        raise ShardError(f"mesh preset {label}: axes must be a list of names, like [\"data\", \"model\"], "
                         f"got {axes!r}")
    axes = tuple(axes)
    if not axes:
        raise ShardError(f"mesh preset {label}: needs `axes`")
    check_axes(axes, f"mesh preset {label}")
    shape = _check_shape(doc.get("shape", [FILL] + [1] * (len(axes) - 1)), len(axes), f"mesh preset {label}")
    rules = parse_rules(base["rules"], "default rules") | parse_rules(doc.get("rules", {}), f"{label} rules")
    param_rules = parse_rules(base["param_rules"], "default param_rules") | parse_rules(
        doc.get("param_rules", {}), f"{label} param_rules"
    )
    return MeshSpec(axes, shape, rules, param_rules, source=label)


def split_mesh_file(spec: str) -> tuple[str, str] | None:
    """`path/to/mesh.toml` -> (the path, ""), `path/to/mesh.toml:4x2` -> (the path, "4x2"); None for a
    spec of another form. Read first: a path may hold '=' or ':' (a folder `lr=3e-4`)."""
    spec = spec.strip()
    if spec.endswith(".toml"):
        return spec, ""
    path, colon, shape = spec.rpartition(":")
    return (path, shape) if colon and path.endswith(".toml") else None


def rename_mesh_file(spec: str, rename: Callable[[Path], str]) -> str:
    """The spec with its mesh file's path given by `rename` and its `:shape` kept; a spec of another
    form as it is."""
    found = split_mesh_file(spec)
    if not found:
        return spec
    path, shape = found
    return rename(Path(path)) + (f":{shape}" if shape else "")


def parse_mesh(spec: str) -> MeshSpec:
    """`8x4` | `data=2,fsdp=2,model=2` | `PRESET` | `PRESET:4x2` | `path/to/mesh.toml`."""
    spec = spec.strip()
    if not spec:
        raise ShardError("empty --mesh: give a shape like 8x4, axes like data=2,model=4, or a preset name")
    default = load_preset("default")
    if _BARE_SHAPE.match(spec):
        shape = tuple(int(s) for s in spec.split("x"))
        if len(shape) not in AXES_FOR_BARE_SHAPE:
            raise ShardError(f"mesh {spec}: a bare shape has 1 to 3 dimensions; name the axes instead (data=2,...)")
        shape = _check_shape(shape, len(shape), f"mesh {spec}")
        return MeshSpec(AXES_FOR_BARE_SHAPE[len(shape)], shape, default.rules, default.param_rules, spec)
    mesh_file = split_mesh_file(spec)
    if "=" in spec and ":" not in spec and not mesh_file:  # PRESET:data=2: a preset, a wrong shape
        axes, shape = [], []
        for part in spec.split(","):
            name, _, size = part.partition("=")
            name = name.strip()
            try:
                shape.append(int(size))
            except ValueError:
                raise ShardError(f"mesh {spec}: size of axis {name!r} must be an integer, got {size!r}") from None
            axes.append(name)
        check_axes(tuple(axes), f"mesh {spec}")
        shape = _check_shape(shape, len(axes), f"mesh {spec}")
        return MeshSpec(tuple(axes), shape, default.rules, default.param_rules, spec)
    name, shape_text = mesh_file or spec.partition(":")[::2]
    preset = load_preset(name)
    if not shape_text:
        return preset
    if not _BARE_SHAPE.match(shape_text):
        raise ShardError(f"mesh {spec}: the part after ':' must be a shape like 4x2 (the preset names its axes: "
                         f"{', '.join(preset.axes)})")
    shape = _check_shape([int(s) for s in shape_text.split("x")], len(preset.axes), f"mesh {spec}")
    return MeshSpec(preset.axes, shape, preset.rules, preset.param_rules, spec)


def devices_needed(spec: MeshSpec, default: int) -> int:
    """How many devices the mesh uses; a shape with a FILL entry uses `default` (the devices there are)."""
    if FILL in spec.shape:
        return default
    return math.prod(spec.shape)


def resolve_shape(spec: MeshSpec, n_devices: int) -> tuple[int, ...]:
    """The concrete shape on `n_devices` devices: FILL takes the rest; the product must equal n_devices."""
    fixed = math.prod(s for s in spec.shape if s != FILL)
    if FILL in spec.shape:
        if n_devices % fixed:
            raise ShardError(
                f"mesh {spec.describe()} cannot fill {n_devices} devices: {n_devices} is not a multiple of {fixed}"
            )
        return tuple(n_devices // fixed if s == FILL else s for s in spec.shape)
    if fixed != n_devices:
        raise ShardError(
            f"mesh {spec.describe()} needs {fixed} devices but {n_devices} exist; on CPU pass "
            f"--simulate-devices {fixed}, or choose a mesh whose sizes multiply to {n_devices}"
        )
    return spec.shape


def build_mesh(spec: MeshSpec, devices=None):
    """A `jax.sharding.Mesh` over `devices` (default: all), axes in GSPMD (Auto) mode.

    With several processes, the outermost axes span processes (hosts) so that the inner axes, which
    carry the heavier traffic (tensor parallel), stay on the fast in-node links.
    """
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_shape(spec, len(devices))
    n_proc = len({d.process_index for d in devices})
    if n_proc > 1:
        dcn = _cross_host_shape(shape, n_proc, spec)
        ici = tuple(s // d for s, d in zip(shape, dcn))
        grid = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=True, allow_split_physical_axes=True
        )
    else:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(grid, spec.axes, axis_types=(AxisType.Auto,) * len(spec.axes))


def split_over_processes(spec: MeshSpec, n_local: int, n_proc: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(processes per axis, devices per axis inside a process) for a mesh over n_proc processes of
    n_local devices each: the process split takes the outermost axes."""
    shape = resolve_shape(spec, n_local * n_proc)
    dcn = _cross_host_shape(shape, n_proc, spec)
    return dcn, tuple(s // d for s, d in zip(shape, dcn))


def _cross_host_shape(shape: tuple[int, ...], n_proc: int, spec: MeshSpec) -> tuple[int, ...]:
    dcn = hosts_per_axis(shape, n_proc)
    if dcn is None:
        raise ShardError(f"mesh {spec.describe(shape)} cannot be split over {n_proc} processes")
    return dcn


def hosts_per_axis(shape: Sequence[int], hosts: int) -> tuple[int, ...] | None:
    """How many hosts each axis of a mesh `shape` spans when `hosts` fill the outermost axes first (as
    build_mesh lays them out); None when they can't be split so."""
    spans, left = [], hosts
    for s in shape:
        g = math.gcd(s, left)
        spans.append(g)
        left //= g
    return tuple(spans) if left == 1 else None
