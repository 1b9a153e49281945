"""Logical axis names -> mesh axes -> PartitionSpec / NamedSharding, for parameters and activations.

Models annotate each parameter with logical axes (flax's `out_sharding` metadata) and constrain key
activations with `constrain`. A `Layout` holds the mesh and the two rule tables (activations, and
parameters = activations + param_rules, Levanter's split) and is the only place that turns names
into mesh axes. Regex rules over parameter paths cover models without annotations.
"""

import contextlib
import contextvars
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shard.axes import ACTIVATION_LAYOUTS, MESH_AXES, MOE_ACTIVATION_LAYOUTS
from shard.errors import ShardError

Rules = Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class Layout:
    """A mesh plus the rules that place every logical axis on it."""

    mesh: jax.sharding.Mesh
    rules: Rules  # activations (and parameters)
    param_rules: Rules = field(default_factory=dict)  # parameters only, on top of `rules`
    regex_rules: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (path regex, logical axes)
    # weight path -> FP8 recipe of its matmuls (shard.config.precision); a weight not here: compute dtype
    precision: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        """A rule's mesh axes as a tuple (a bare name is one axis, not its letters), each a mesh axis
        shard knows or this mesh has: a misspelt one would replicate the dimension in silence."""
        known = set(MESH_AXES) | set(self.mesh.axis_names)
        for name in ("rules", "param_rules"):
            table = {k: (v,) if isinstance(v, str) else tuple(v) for k, v in getattr(self, name).items()}
            for logical, axes in table.items():
                if unknown := [a for a in axes if a not in known]:
                    raise ShardError(f"{name}: {logical!r} maps to {unknown[0]!r}, which is not a mesh axis "
                                     f"(one of {', '.join(sorted(known))})")
            object.__setattr__(self, name, table)

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    def degree(self, logical: str, *, param: bool = False) -> int:
        """How many ways a logical axis is split on this mesh."""
        return math.prod(self.axis_sizes[a] for a in self.mesh_axes(logical, param=param))

    def mesh_axes(self, logical: str, *, param: bool = False) -> tuple[str, ...]:
        """The mesh axes (of size > 1) that split a logical axis on this mesh, outermost first."""
        sizes = self.axis_sizes
        return tuple(a for a in self._table(param).get(logical, ()) if sizes[a] > 1)

    def describe_axes(self, logical: str, *, param: bool = False) -> str:
        """Those axes with their sizes, for messages: `data=2xfsdp=4`."""
        return "x".join(f"{a}={self.axis_sizes[a]}" for a in self.mesh_axes(logical, param=param))

    def _table(self, param: bool) -> dict[str, tuple[str, ...]]:
        merged = dict(self.rules) | (dict(self.param_rules) if param else {})
        present = set(self.mesh.axis_names)
        return {k: tuple(a for a in v if a in present) for k, v in merged.items()}

    def spec(self, logical_axes: tuple[str | None, ...], *, param: bool = False, what: str = "") -> PartitionSpec:
        """PartitionSpec for a tensor whose dims carry these logical names (None: not a named dim)."""
        table = self._table(param)
        used: dict[str, str] = {}
        out = []
        for name in logical_axes:
            if name is None:
                out.append(None)
                continue
            if name not in table:
                raise ShardError(
                    f"{what or 'tensor'}: logical axis {name!r} has no rule; map it in the mesh preset "
                    f"or with --set rules.{name}=AXIS (or =none to replicate)"
                )
            axes = table[name]
            for a in axes:
                if a in used:
                    raise ShardError(
                        f"{what or 'tensor'}: mesh axis {a!r} is used by both {used[a]!r} and {name!r}; "
                        "fix the rules so each mesh axis shards one dimension"
                    )
                used[a] = name
            out.append(axes[0] if len(axes) == 1 else (axes or None))
        return PartitionSpec(*out)

    def sharding(self, logical_axes, *, param: bool = False, what: str = "") -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(tuple(logical_axes), param=param, what=what))

    def check_activations(self, moe: bool = False) -> None:
        """A ShardError unless every activation layout the models use (ACTIVATION_LAYOUTS, and with
        `moe` the expert layers' too) has a valid spec: the rules are checked before anything is
        traced, by every command that builds a layout."""
        for logical in ACTIVATION_LAYOUTS + (MOE_ACTIVATION_LAYOUTS if moe else ()):
            self.spec(logical, what="activation")


def mesh_axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: None, one axis name, or a tuple of them."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entries(spec: PartitionSpec, ndim: int) -> tuple:
    """A PartitionSpec's entry for each of `ndim` dims (None past its end, where it leaves dims whole)."""
    return (*spec, *(None,) * (ndim - len(spec)))


def check_divisible(what: str, shape: tuple[int, ...], logical_axes, spec: PartitionSpec, mesh,
                    param_rules: Rules | None = None) -> None:
    """Each sharded dimension must split evenly; say which tensor, dimension and mesh axes if not, and
    the `--set` that replicates the dimension (in param_rules when a rule there placed it)."""
    sizes = dict(mesh.shape)
    for dim, (n, entry) in enumerate(zip(shape, spec_entries(spec, len(shape)))):
        axes = mesh_axes_of(entry)
        if not axes:
            continue
        ways = math.prod(sizes[a] for a in axes)
        if n % ways:
            axes_text = "x".join(f"{a}={sizes[a]}" for a in axes)
            raise ShardError(
                f"{what}: dimension {dim} ({logical_axes[dim]}) of size {n} does not divide by mesh axis "
                f"{axes_text} ({ways} ways); change the mesh or the rule for {logical_axes[dim]!r} (e.g. --set "
                f"{'param_rules' if logical_axes[dim] in (param_rules or {}) else 'rules'}.{logical_axes[dim]}=none "
                "to replicate it)"
            )


def path_str(path) -> str:
    """`('layers', 'wq')` -> `layers/wq` for tables and regex rules."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def logical_axes_of(abstract_state, regex_rules=()) -> dict:
    """Logical axes for every parameter: from its annotation, else the first matching regex rule.

    A parameter neither annotated nor matched is an error, never silently replicated; so is a regex
    rule that decides no parameter (a typo, or a pattern for parameters whose annotations win).
    """
    from flax import nnx

    flat = {}
    missing = []
    annotated, decided = set(), set()  # names with axes of their own; the regex rules that gave some
    for path, var in nnx.to_flat_state(abstract_state):
        name = path_str(path)
        meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
        axes = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
        if axes is not None:
            annotated.add(name)
        else:
            rule = next((i for i, (rx, _) in enumerate(regex_rules) if re.fullmatch(rx, name)), None)
            if rule is not None:
                decided.add(rule)
                axes = tuple(regex_rules[rule][1])
        if axes is None:
            missing.append(name)
            continue
        shape = var.get_value().shape
        if len(axes) != len(shape):
            raise ShardError(f"parameter {name}: {len(axes)} logical axes {tuple(axes)} for shape {shape}")
        flat[path] = tuple(axes)
    if missing:
        raise ShardError(
            f"parameter(s) without logical axes and no regex rule: {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + "; annotate them or add a param_regex rule"
        )
    for i, (rx, _) in enumerate(regex_rules):
        if i not in decided:
            raise ShardError(_undeciding_rule(rx, annotated, [path_str(p) for p in flat]))
    return _unflatten(flat)


def _undeciding_rule(pattern: str, annotated: set[str], names: list[str]) -> str:
    """Why a param_regex rule decides no parameter, for its error."""
    matched = [n for n in names if re.fullmatch(pattern, n)]
    if not matched:
        example = next((n for n in names if "/" in n), names[0])
        return (f"param_regex {pattern!r} matches no parameter (a full match of paths such as {example}; "
                "`shard inspect` lists them)")
    own = [n for n in matched if n in annotated]
    if own:
        whose = f"{own[0]} and {len(own) - 1} more carry logical axes of their own" if len(own) > 1 else \
            f"{own[0]} carries logical axes of its own"
        return (f"param_regex {pattern!r} decides no parameter: {whose}, which win over it; "
                "param_rules.AXIS=MESH_AXES changes how an axis is sharded")
    return f"param_regex {pattern!r} decides no parameter: an earlier pattern matches {matched[0]} first"


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        keys = [getattr(k, "key", k) for k in path]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return out


def param_shardings(abstract_params: dict, logical: dict, layout: Layout) -> dict:
    """NamedSharding for every parameter, with its divisibility checked against the mesh."""

    def one(path, sds, axes):
        what = f"parameter {path_str(path)} {tuple(sds.shape)}"
        spec = layout.spec(axes, param=True, what=what)
        check_divisible(what, tuple(sds.shape), axes, spec, layout.mesh, layout.param_rules)
        return NamedSharding(layout.mesh, spec)

    return jax.tree_util.tree_map_with_path(one, abstract_params, logical, is_leaf=lambda x: isinstance(x, tuple))


def like_params(tree, abstract_params: dict, params_shardings: dict, mesh):
    """Shardings for a tree (optimizer state) whose leaves mirror parameters: same path suffix and
    shape get the parameter's sharding; everything else (counts, scalars, factored moments) is replicated."""
    by_path = {}
    for (path, sds), s in zip(jax.tree_util.tree_flatten_with_path(abstract_params)[0],
                              jax.tree.leaves(params_shardings), strict=True):
        by_path[tuple(getattr(k, "key", k) for k in path)] = (tuple(sds.shape), s)
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(path, leaf):
        keys = []
        for k in reversed(path):
            if not isinstance(k, jax.tree_util.DictKey):
                break
            keys.insert(0, k.key)
        shape, sharding = by_path.get(tuple(keys), (None, replicated))
        return sharding if shape == tuple(leaf.shape) else replicated

    return jax.tree_util.tree_map_with_path(one, tree)


# --- activations -------------------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("shard_layout", default=None)


@contextlib.contextmanager
def activation_layout(layout: Layout | None) -> Iterator[None]:
    """While tracing a step under this context, `constrain` pins activations to the layout."""
    token = _ACTIVE.set(layout)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_layout() -> Layout | None:
    """The layout being traced under (`activation_layout`), or None."""
    return _ACTIVE.get()


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...], *, param: bool = False,
              drop: tuple[str, ...] = (), onto: str | None = None) -> jax.Array:
    """Pin an activation's sharding by logical names (`param=True`: by the parameter rules, as a weight
    is stored; `drop`: mesh axes to replicate over instead, or with `onto`, one of `logical_axes`, to
    split that dim over after its own: the untied head's vocab split); a no-op outside `activation_layout`.

    Without these, XLA may pick layouts that regather weights or activations between layers
    (measured: FSDP moved 4x the bytes without them).
    """
    layout = _ACTIVE.get()
    if layout is None:
        return x
    sharding = layout.sharding(logical_axes, param=param, what="activation")
    if drop:
        entries = [_without(e, set(drop)) for e in sharding.spec]
        if onto is not None:
            i = logical_axes.index(onto)
            entries[i] = _without((*mesh_axes_of(entries[i]), *drop), set())
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*entries))
    inner = jax.sharding.get_abstract_mesh()
    if not inner.empty and inner.manual_axes:
        # Inside a shard_map (pipeline stages, ring attention): constrain over the axes still automatic.
        manual = set(inner.manual_axes)
        sharding = NamedSharding(inner, PartitionSpec(*(_without(e, manual) for e in sharding.spec)))
    return jax.lax.with_sharding_constraint(x, sharding)


def _without(entry, axes: set):
    kept = tuple(a for a in mesh_axes_of(entry) if a not in axes)
    return kept[0] if len(kept) == 1 else (kept or None)
