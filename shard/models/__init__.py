"""Model definitions, installed as `shard.models`. Configs import without JAX; the modules load lazily."""

from shard.config.model import PRESETS, ModelConfig

__all__ = ["PRESETS", "ModelConfig", "build"]


def build(cfg: ModelConfig, *, seed: int = 0):
    """A freshly initialised model (concrete arrays). Call under jit/eval_shape for sharded or abstract use."""
    from shard.models.llama import Llama

    from flax import nnx

    with nnx.use_eager_sharding(False):
        return Llama(cfg, rngs=nnx.Rngs(params=seed))
