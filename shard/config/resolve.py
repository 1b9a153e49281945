"""The run's config resolved from layers, defaults < TOML file < flags < --set: unknown keys and
ill-typed values are errors, reported once, before JAX starts. Also the resolved config written back
as TOML, and two configs compared key by key.
"""

import dataclasses
import math
import re
import tomllib
import types
import typing

import tomli_w

from shard import tomlfiles
from shard.config.model import ModelConfig, field_names
from shard.config.presets import PRESETS
from shard.config.train import TrainConfig
from shard.errors import ShardError
from shard.config.rules import parse_rules
from shard.config.precision import parse_precision

_DICT_SECTIONS = {"rules", "param_rules", "param_regex", "precision"}


def parse_value(text: str):
    """A --set value: TOML syntax when it parses (3e-4, true, [1, 2], "x"), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sets(items: list[str]) -> dict:
    """`["optimizer.lr=3e-4", "model.d_model=128"]` -> nested overrides. A key that holds text takes the
    value as typed (`eval.path=2024-01-01` is a folder, not a TOML date), or a quoted TOML string."""
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ShardError(f"--set expects key=value, got {item!r}")
        parsed = parse_value(value.strip())
        if _field_type(key.strip()) is str and not isinstance(parsed, str):
            parsed = value.strip()
        _put(out, key.strip(), parsed)
    return out


def _field_type(dotted: str):
    """The type of the config field a dotted key names (None for no such field, or a rule table's)."""
    cls, *parents = (TrainConfig, *dotted.split(".")[:-1])
    for part in parents:
        f = next((f for f in dataclasses.fields(cls) if f.name == part), None)
        if f is None or not dataclasses.is_dataclass(f.type):
            return None
        cls = f.type
    return next((f.type for f in dataclasses.fields(cls) if f.name == dotted.split(".")[-1]), None)


def nested(flat: dict[str, object]) -> dict:
    """`{"data.batch": 8}` -> `{"data": {"batch": 8}}`: values as they are, not parsed."""
    out: dict = {}
    for key, value in flat.items():
        _put(out, key, value)
    return out


def _put(tree: dict, dotted: str, value) -> None:
    head, _, rest = dotted.partition(".")
    if head in _DICT_SECTIONS and rest:  # rule tables: the rest of the key may contain dots (regexes)
        if len(rest) > 1 and rest[0] == rest[-1] and rest[0] in "\"'":  # a TOML-quoted key
            rest = rest[1:-1]
        tree.setdefault(head, {})[rest] = value
        return
    if not rest:
        tree[head] = value
        return
    node = tree.setdefault(head, {})
    if not isinstance(node, dict):
        raise ShardError(f"config key {head!r} is a value, not a section, so {dotted!r} is not a key")
    _put(node, rest, value)


def merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def layer(base: dict | None, from_file: dict, settings: dict, sets=()) -> dict:
    """A run's config keys, as one nested dict: defaults < `base` (a resumed run's saved config, or the
    model of the weights it starts from) < the config file < `settings` (what the flags set) < `sets`
    ("key=value" items of --set)."""
    check_settings(settings)
    out = merge(merge(base or {}, from_file), settings)
    out = merge(out, parse_sets(list(sets or [])))
    if isinstance(model := out.get("model"), dict):  # not: resolve says what else it is
        check_model_named_over_file(from_file.get("model"), model.get("name"))
    return out


def check_settings(settings: dict) -> None:
    """The values a flag may not take though the config file may (an empty run_dir is the default there)."""
    run_dir = settings.get("run_dir")
    if run_dir is not None and not str(run_dir).strip():
        raise ShardError("empty --run-dir: name a folder, or leave the flag out for runs/<model>-<mesh>-<time>")
    mesh = settings.get("mesh")
    simulate = mesh.get("simulate_devices") if isinstance(mesh, dict) else None
    if simulate is not None and simulate <= 0:
        raise ShardError(f"--simulate-devices must be positive, got {simulate}")


def check_model_named_over_file(file_model, name) -> None:
    """A config file whose [model] describes one model whole (a run's config.toml lists every key)
    would amend the preset --model names into that model under the other name. A partial [model] (a
    recipe's remat or dtype) amends whichever model is named, as documented."""
    if not isinstance(file_model, dict) or file_model.get("name", name) == name:
        return
    if set(file_model) >= set(field_names()):
        raise ShardError(f"--model {name}: the config file describes model {file_model['name']} whole (every "
                         f"[model] key, as a run's config.toml does), which would give {name} its dimensions; leave "
                         "out --model, or the file's [model] section")


def load_file(path: str) -> dict:
    doc = tomlfiles.read(path, f"config file {path}")
    sections = {f.name for f in dataclasses.fields(TrainConfig) if dataclasses.is_dataclass(f.type)}
    for key in sections & set(doc):
        if not isinstance(doc[key], dict):
            raise ShardError(f"config file {path}: {key} must be a [{key}] table, got {type(doc[key]).__name__}")
    try:
        check_types(doc)
    except ShardError as e:
        raise ShardError(f"config file {path}: {e}") from None
    return doc


def check_types(overrides: dict) -> None:
    """Each key a config file sets is a known key of the right type, checked on the file alone: a flag
    that later overrides the same key must not hide a wrong value in the file. Rules between keys wait
    for the whole config (resolve), since flags may complete it."""
    _build(ModelConfig, _model_section(overrides), "model.")
    _build(TrainConfig, {k: v for k, v in overrides.items() if k != "model"}, "")


def _coerce(value, tp, key: str):
    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isnan(value):
                raise ShardError(f"config key {key} expects a number, got nan")
            return float(value)
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif origin in (types.UnionType, typing.Union):
        return value
    name = getattr(tp, "__name__", str(tp))
    raise ShardError(f"config key {key} expects {name}, got {value!r}")


def _regex(text: str, key: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise ShardError(f"config key {key}: {text!r} is not a regular expression ({e})") from None
    return text


def _build(cls, overrides: dict, prefix: str, base=None):
    base = base if base is not None else cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    changes = {}
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            known = ", ".join(fields)
            raise ShardError(f"unknown config key {dotted!r} (known{' in ' + prefix[:-1] if prefix else ''}: {known})")
        tp = fields[key].type
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ShardError(f"config key {dotted} is a section; set its fields, e.g. {dotted}.x=...")
            changes[key] = _build(tp, value, dotted + ".", getattr(base, key))
        elif key in ("rules", "param_rules"):
            changes[key] = parse_rules(value, dotted)
        elif key == "precision":
            changes[key] = parse_precision(value, dotted)
        elif key == "param_regex":
            if not isinstance(value, dict):
                raise ShardError(f"config key {dotted} must be a table of regex = [logical axes]")
            changes[key] = {_regex(rx, f"{dotted}.{rx}"): _coerce(ax, tuple[str, ...], f"{dotted}.{rx}")
                            for rx, ax in value.items()}
        else:
            changes[key] = _coerce(value, tp, dotted)
    return dataclasses.replace(base, **changes)


def _model_section(overrides: dict) -> dict:
    model = overrides.get("model", {})
    if not isinstance(model, dict):
        raise ShardError("config key 'model' is a section; use --model NAME or model.name=NAME")
    return model


def resolve(overrides: dict) -> TrainConfig:
    """The validated config from user overrides; `model.name` picks the preset the other model keys amend."""
    model_over = dict(_model_section(overrides))
    name = _coerce(model_over.get("name", TrainConfig().model.name), str, "model.name")
    complete = set(model_over) >= set(field_names())
    if name not in PRESETS and not complete:  # a complete description (an imported model) needs no preset
        raise ShardError(f"unknown model {name!r} (known: {', '.join(PRESETS)})")
    model = _build(ModelConfig, model_over, "model.", PRESETS.get(name, ModelConfig()))
    rest = {k: v for k, v in overrides.items() if k != "model"}
    cfg = dataclasses.replace(_build(TrainConfig, rest, ""), model=model)
    cfg.validate()
    return cfg


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config, written so that `--config` reads it back to the same thing."""
    return tomli_w.dumps(_plain(dataclasses.asdict(cfg)))


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [_plain(v) for v in x]
    return x


def differences(a: TrainConfig, b: TrainConfig, ignore: tuple[str, ...] = ()) -> list[tuple[str, object, object]]:
    """The dotted keys where two configs differ, with both values, in field order (model first);
    keys in `ignore` and below are skipped."""
    out: list[tuple[str, object, object]] = []

    def walk(x, y, prefix: str) -> None:
        for k in [*x, *(k for k in y if k not in x)]:  # field order: model first
            key = f"{prefix}{k}"
            if key in ignore:
                continue
            xv, yv = x.get(k), y.get(k)
            if isinstance(xv, dict) and isinstance(yv, dict):
                walk(xv, yv, key + ".")
            elif xv != yv:
                out.append((key, xv, yv))

    walk(_plain(dataclasses.asdict(a)), _plain(dataclasses.asdict(b)), "")
    return out
