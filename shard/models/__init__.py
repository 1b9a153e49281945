"""The model: a Llama-style decoder (llama.py) and its mixture of experts (moe.py). Their configs are
shard.config.model's, their presets shard.config.presets'; the modules load lazily."""

from shard.config.model import ModelConfig

__all__ = ["build"]


def build(cfg: ModelConfig, *, seed: int = 0, lora=None):
    """A freshly initialised model (concrete arrays), with LoRA adapters where `lora` (a LoraConfig) has a
    rank. Call under jit/eval_shape for sharded or abstract use."""
    from shard.models.llama import Llama

    from flax import nnx

    with nnx.use_eager_sharding(False):
        return Llama(cfg, rngs=nnx.Rngs(params=seed), lora=lora)
