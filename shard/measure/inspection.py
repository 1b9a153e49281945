"""The sharding table of every parameter, and per-device bytes, computed from shapes alone."""

import math

import numpy as np

from shard.axes import STAGE
from shard.parallel.schedule import check as schedule_check
from shard.sharding.rules import Layout, path_str
from shard.training.state import StateSpec


def bytes_per_device(sds, sharding) -> int:
    """Bytes one device holds of this array (shards are even: the rules checked divisibility)."""
    return math.prod(sharding.shard_shape(tuple(sds.shape))) * np.dtype(sds.dtype).itemsize


def _leaves_with_paths(tree):
    import jax

    return jax.tree_util.tree_flatten_with_path(tree)[0]


def param_table(spec: StateSpec, layout: Layout) -> list[dict]:
    """One row per parameter: name, shape, dtype, logical axes, PartitionSpec, bytes in all and per device."""
    shardings = {path_str(p): s for p, s in _leaves_with_paths(spec.shardings["params"])}
    logical = {path_str(p): a for p, a in _leaves_with_paths_tuples(spec.logical)}
    rows = []
    for path, sds in _leaves_with_paths(spec.abstract["params"]):
        name = path_str(path)
        sharding = shardings[name]
        rows.append({
            "name": name,
            "shape": list(sds.shape),
            "dtype": str(np.dtype(sds.dtype)),
            "logical_axes": list(logical[name]),
            "partition_spec": _spec_text(sharding.spec, len(sds.shape)),
            "bytes": math.prod(sds.shape) * np.dtype(sds.dtype).itemsize,
            "bytes_per_device": bytes_per_device(sds, sharding),
        })
    return rows


def _leaves_with_paths_tuples(tree):
    import jax

    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))[0]


def _spec_text(spec, ndim: int) -> list:
    entries = list(spec) + [None] * (ndim - len(spec))
    return [e if e is None or isinstance(e, str) else list(e) for e in entries]


def summary(spec: StateSpec, layout: Layout) -> dict:
    """The whole document `shard inspect --json` prints."""
    rows = param_table(spec, layout)
    padding = spec.model.vocab_padding_params() if spec.model is not None else 0
    opt_bytes = sum(
        bytes_per_device(a, s)
        for (_, a), (_, s) in zip(_leaves_with_paths(spec.abstract["opt_state"]),
                                  _leaves_with_paths(spec.shardings["opt_state"]))
    )
    return {
        "mesh": dict(layout.mesh.shape),
        "devices": int(layout.mesh.size),
        # the model's own count, the stored vocab padding apart (param_count + vocab_padding: what is stored)
        "param_count": sum(math.prod(r["shape"]) for r in rows) - padding,
        "vocab_padding": padding,
        "params": rows,
        "params_bytes_per_device": sum(r["bytes_per_device"] for r in rows),
        "opt_state_bytes_per_device": opt_bytes,
    }


def pipeline_doc(kind: str, stages: int, microbatches: int, virtual: int = 1) -> dict:
    """The schedule `shard inspect` draws: its bubble by formula and by table, the inputs each stage
    holds at its peak, and the chart (stages x ticks)."""
    from shard.parallel.schedule import bubble_formula, build

    sch = build(kind, stages, microbatches, virtual)
    return {"schedule": kind, "stages": stages, "microbatches": microbatches, "virtual_stages": virtual,
            "ticks": sch.ticks, "bubble_formula": bubble_formula(kind, stages, microbatches, virtual),
            "bubble_schedule": sch.idle_fraction(), "held": sch.held(), "chart": sch.chart()}


def inspect_config(cfg, devices, compiled: bool = False) -> dict:
    """`shard inspect`'s document: every parameter's layout on cfg's mesh over `devices` (`summary`), and
    with `compiled` what the step compiled from shapes moves and holds (shard.measure.analysis)."""
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.training.state import state_spec

    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices)
    doc = summary(state_spec(cfg.model, cfg.optimizer, cfg.steps, layout, lora=cfg.lora), layout)
    doc["model"] = cfg.model.name
    if (stages := layout.axis_sizes.get(STAGE, 1)) > 1:
        p = cfg.pipeline
        schedule_check(p.schedule, stages, p.microbatches, p.virtual_stages, cfg.model.n_layers)
        doc["pipeline"] = pipeline_doc(p.schedule, stages, p.microbatches, p.virtual_stages)
    if compiled:
        from shard.measure.analysis import analyze
        from shard.training.step import check_batch

        check_batch(cfg, layout)
        doc["batch"], doc["seq_len"] = cfg.data.batch, cfg.data.seq_len
        doc.update(analyze(cfg, layout).to_dict())
    return doc
