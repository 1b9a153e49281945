"""Rule tables as the config holds them: `{logical axis: mesh axes}`, checked against the names shard
knows (shard.axes), from a mesh preset, a config file or `--set`."""

from shard.axes import LOGICAL_AXES, MESH_AXES
from shard.errors import ShardError


def _axes_list(value, where: str) -> tuple[str, ...]:
    """A rule's target: a mesh axis name, a list of them, or empty/none for replicated."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip() and v.strip().lower() != "none"]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ShardError(f"{where}: expected a mesh axis name or a list of them, got {value!r}")
    check_axes(tuple(value), where)
    return tuple(value)


def parse_rules(table: dict, where: str) -> dict[str, tuple[str, ...]]:
    """Validate a `{logical axis: mesh axes}` table from TOML or `--set`."""
    if not isinstance(table, dict):
        raise ShardError(f"{where}: expected a table of logical axis = mesh axes")
    out = {}
    for logical, target in table.items():
        if logical not in LOGICAL_AXES:
            raise ShardError(f"{where}: unknown logical axis {logical!r} (known: {', '.join(LOGICAL_AXES)})")
        out[logical] = _axes_list(target, f"{where}.{logical}")
    return out


def check_axes(axes: tuple[str, ...], where: str) -> None:
    for a in axes:
        if a not in MESH_AXES:
            raise ShardError(f"{where}: unknown mesh axis {a!r} (known: {', '.join(MESH_AXES)})")
    if len(set(axes)) != len(axes):
        raise ShardError(f"{where}: mesh axis named twice in {', '.join(axes)}")
