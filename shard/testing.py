"""Fixtures shared by tests, notebooks and benchmarks: tiny configs and meshes on simulated devices."""

from shard import config as config_mod
from shard.config import TrainConfig


def tiny_config(mesh: str = "8x1", **sets) -> TrainConfig:
    """The tiny model on `mesh`, 3 steps of batch 8 x 32; `sets` are --set style keys with '__' for '.'.

    >>> tiny_config("2x4", data__batch=16, model__n_kv_heads=4)
    """
    overrides = {"model": {"name": "tiny"}, "mesh": {"spec": mesh}, "steps": 3, "log_every": 1,
                 "data": {"batch": 8, "seq_len": 32}}
    items = [f"{k.replace('__', '.')}={_toml(v)}" for k, v in sets.items()]
    return config_mod.resolve(config_mod.merge(overrides, config_mod.parse_sets(items)))


def _toml(v) -> str:
    import json

    return json.dumps(v) if not isinstance(v, (list, tuple)) else json.dumps(list(v))


def devices_for(mesh: str):
    """The first devices a mesh needs (so a 1x1 mesh runs inside an 8-device test process)."""
    import jax

    from shard.mesh import devices_needed, parse_mesh

    return jax.devices()[: devices_needed(parse_mesh(mesh), len(jax.devices()))]


def fake_mesh(mesh: str = "2x4"):
    """A jax Mesh from a shard mesh spec over the simulated devices."""
    from shard.mesh import build_mesh, parse_mesh

    return build_mesh(parse_mesh(mesh), devices_for(mesh))


def train_losses(cfg: TrainConfig) -> list[float]:
    """Per-step losses of a short run (cfg.log_every should be 1)."""
    from shard.loop import train

    return [r["loss"] for r in train(cfg, devices=devices_for(cfg.mesh.spec))]
