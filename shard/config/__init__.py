"""The run's configuration as frozen dataclasses (no JAX): the training config, the model config and presets."""
