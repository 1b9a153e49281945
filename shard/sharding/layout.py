"""The Layout a config runs on: the mesh over these devices and the preset's rules amended by the config's."""

from shard.config.precision import weight_recipes
from shard.config.train import TrainConfig
from shard.sharding.mesh import MeshSpec, build_mesh
from shard.sharding.rules import Layout


def make_layout(cfg: TrainConfig, mesh_spec: MeshSpec, devices=None) -> Layout:
    """The mesh for these devices, with the preset's rules amended by the config's."""
    mesh = build_mesh(mesh_spec, devices)
    layout = Layout(
        mesh=mesh,
        rules=mesh_spec.rules | cfg.rules,
        param_rules=mesh_spec.param_rules | cfg.param_rules,
        regex_rules=tuple(cfg.param_regex.items()),
        precision=weight_recipes(cfg.precision, cfg.model),
    )
    layout.check_activations(moe=bool(cfg.model.n_experts))
    return layout
