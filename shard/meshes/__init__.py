"""Mesh and rule presets as TOML data, installed as `shard.meshes`."""
