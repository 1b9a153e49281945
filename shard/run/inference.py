"""A model's weights from outside a run (a shard checkpoint or run dir, or a Hugging Face folder), read
once and laid out on a mesh: what `shard generate`, `shard eval` (and its lm-eval tasks), `shard export-hf`
and `shard train --init-from` start from.

    model = open_model("runs/tiny", mesh="1x4")           # JAX started for the mesh, as train starts it
    print(model.tokenizer.decode(model.generator(64).generate([72, 105], 16, Sampling(0.0), seed=0)))
"""

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING

from shard import config as config_mod
from shard.config.model import ModelConfig
from shard.config.train import TrainConfig
from shard.observe.console import note as console_note
from shard.observe.console import warn as console_warn
from shard.run.devices import Notice, start_devices
from shard.sharding.mesh import MeshSpec, parse_mesh

if TYPE_CHECKING:  # JAX loads once the devices are settled (start_jax), not on import
    import numpy as np

    from shard.sharding.rules import Layout


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """Weights read once: their model, their params on the host (read tensor by tensor when asked), and,
    with a layout, the params placed into its shardings on first use of `params` (each device reading
    its own shards: the host never holds the model twice)."""

    source: str
    config: TrainConfig  # the rules and mesh it is laid out by, with the weights' model
    host_params: dict
    host_router_bias: "np.ndarray | None"  # the MoE balancing bias its experts were chosen by, if saved
    layout: "Layout | None" = None

    @property
    def model(self) -> ModelConfig:
        return self.config.model

    @functools.cached_property
    def spec(self):
        """The state spec of the params on the layout (the default optimizer's: only the params are read)."""
        from shard.training.state import state_spec

        return state_spec(self.model, self.config.optimizer, 1, self._layout())

    @functools.cached_property
    def params(self) -> dict:
        """The params in the layout's shardings; without a layout, on the host."""
        from shard.run import weights

        return weights.place(self.host_params, self.spec) if self.layout is not None else self.host_params

    @functools.cached_property
    def router_bias(self):
        """The router bias replicated on the layout's mesh (None: none saved)."""
        from shard.training.state import place_router_bias

        return place_router_bias(self.host_router_bias, self.spec)

    @functools.cached_property
    def tokenizer(self):
        """The tokenizer that goes with the weights (shard.run.tokenizer.tokenizer_for); None where none does."""
        from shard.run.tokenizer import tokenizer_for

        return tokenizer_for(self.source, self.model.vocab_size)

    def generator(self, max_len: int):
        """A KV-cache sampler (shard.training.generate.Generator) over the placed params, up to `max_len`
        positions."""
        from shard.training.generate import Generator

        return Generator(self.model, self.spec.graphdef, self.params, self._layout(), max_len=max_len,
                         router_bias=self.router_bias)

    def _layout(self) -> "Layout":
        if self.layout is None:
            raise ValueError(f"the weights of {self.source} were read onto the host, with no mesh to place them on")
        return self.layout


def load_model(source: str | Path, cfg: TrainConfig | None = None, mesh_spec: MeshSpec | None = None,
               devices=None, *, inference: bool = True) -> LoadedModel:
    """The weights at `source`, laid out on `mesh_spec` over `devices` by `cfg`'s rules (without them: on
    the host). `inference`: the model as evaluation and generation run it (ModelConfig.for_inference on
    this backend); else as saved, for training to start from or export; either way with its saved router
    bias."""
    from shard.run import weights
    from shard.sharding.layout import make_layout

    model, params, bias = weights.load_with_router_bias(source, inference)
    cfg = dataclasses.replace(cfg or TrainConfig(), model=model)
    layout = make_layout(cfg, mesh_spec, devices) if mesh_spec is not None else None
    return LoadedModel(str(source), cfg, params, bias, layout)


def open_model(source: str | Path, mesh: str | None = "1x1", *, simulate_devices: int | None = None,
               sets: list[str] | None = None, inference: bool = True, warn: Notice = console_warn,
               note: Notice = console_note) -> LoadedModel:
    """`load_model` for a command: JAX started first with the devices `mesh` needs (simulated on a CPU, as
    `shard train` starts them), `sets` the rules (rules.*, param_rules.*, param_regex.*). mesh=None: the
    params stay on the host (JAX started on one device)."""
    cfg, mesh_spec, devices = start_jax(mesh or "1x1", simulate_devices, sets, warn=warn, note=note)
    if mesh is None:
        return load_model(source, inference=inference)
    return load_model(source, cfg, mesh_spec, devices, inference=inference)


def start_jax(mesh: str = "1x1", simulate_devices: int | None = None, sets: list[str] | None = None, *,
              warn: Notice = console_warn, note: Notice = console_note):
    """(config, mesh spec, devices) for a command that needs a mesh and no run: the config of `mesh` and
    `sets` alone, JAX started with the devices it needs, as for train."""
    settings = {"mesh": {"spec": mesh} | ({"simulate_devices": simulate_devices} if simulate_devices is not None
                                          else {})}
    cfg = config_mod.resolve(config_mod.layer(None, {}, settings, sets or []))
    spec = parse_mesh(cfg.mesh.spec)
    return cfg, spec, start_devices(cfg, spec, warn=warn, note=note)
