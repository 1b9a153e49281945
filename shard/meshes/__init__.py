"""Mesh and rule presets as TOML data, read with importlib.resources."""
