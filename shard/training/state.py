"""The train state (step, params, optimizer state, and the MoE router bias where balancing uses one): its
shapes, its shardings, and its sharded init.

Everything here is computed from shapes first (`jax.eval_shape`), so inspecting a 13B model allocates
nothing; the real init is one jit with out_shardings, so no device ever holds the whole model.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shard import models
from shard.config.params import model_params
from shard.config.precision import AMAX_HISTORY, DELAYED
from shard.config.finetune import LoraConfig
from shard.config.train import OptimizerConfig
from shard.errors import ShardError
from shard.config.model import ModelConfig
from shard.sharding.rules import Layout, like_params, logical_axes_of, param_shardings, path_str


@dataclass(frozen=True)
class StateSpec:
    """Shapes and shardings of the train state, and the pieces the step needs."""

    graphdef: nnx.GraphDef
    abstract: dict  # {"step", "params", "opt_state"[, "router_bias"]} of ShapeDtypeStruct
    shardings: dict  # same tree of NamedSharding
    logical: dict  # params tree of logical-axis tuples
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    model: ModelConfig | None = None  # the hyperparameters the params were built with
    # The schedule's numbers (peak and final lr, warm-up and decay steps), which the compiled step takes
    # as arguments, and the (tx, schedule) built from them, traced or not; none for a tx of one's own.
    schedule_args: dict = field(default_factory=dict)
    optimizer_from: Callable[[dict], tuple] | None = None
    # LoRA (rank > 0): the params hold adapters beside the frozen base weights, and the optimizer state
    # mirrors the adapters alone (shard.training.lora); None: every parameter is trained.
    lora: LoraConfig | None = None
    # MuonClip's QK-clip threshold (optimizer.qk_clip): the step records each head's largest attention
    # logit and scales down the query (and key) weights of heads past it; 0: off
    qk_clip: float = 0.0
    # the weights in fp8_delayed (shard.config.precision), whose amax histories the state holds as "fp8"
    fp8_delayed: tuple[str, ...] = ()

    def trainable(self, params):
        """The part of a params tree (arrays, shardings, shapes) the optimizer updates: the adapters
        under LoRA, else the whole tree."""
        if self.lora is None:
            return params
        from shard.training.lora import split

        return split(params)[0]

    def with_trainable(self, params, trained):
        """`params` with its `trainable` part replaced by `trained`."""
        if self.lora is None:
            return trained
        from shard.training.lora import merge, split

        return merge(trained, split(params)[1])

    def optimizer(self, args: dict) -> tuple[optax.GradientTransformation, optax.Schedule]:
        """(tx, schedule) with the schedule's numbers `args` (inside the step: its traced arguments)."""
        return self.optimizer_from(args) if self.optimizer_from is not None else (self.tx, self.schedule)

    def abstract_with_shardings(self) -> dict:
        """The state as ShapeDtypeStructs that carry their shardings (for AOT lowering and restore)."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract, self.shardings
        )

    def check_params_fit(self, params, source: str, hint: str = "", part: str = "all") -> None:
        """A ShardError naming the first parameter that `params` (a tree of anything with a shape: arrays
        or stored metadata) from `source` ("the weights", "checkpoint DIR") lacks, holds in another shape,
        or holds beyond the model's; `hint` ends the messages about a missing or an extra one. `part`:
        "all" the params, under LoRA "adapters" or "base" alone."""
        def shapes(tree):
            return {path_str(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]}

        wanted = self.abstract["params"]
        if part != "all" and self.lora is not None:
            from shard.training.lora import split

            wanted = split(wanted)[0 if part == "adapters" else 1]
        have, wanted = shapes(params), shapes(wanted)
        for name, shape in wanted.items():
            if name not in have:
                raise ShardError(f"parameter {name} {shape} of the model is not in {source}{hint}")
            if have[name] != shape:
                raise ShardError(f"parameter {name} is {have[name]} in {source} but {shape} in the model")
        extra = sorted(set(have) - set(wanted))
        if extra:
            name = extra[0]
            raise ShardError(f"parameter {name} {have[name]} in {source} is not in the model{hint}")

    def check_opt_state_fits(self, opt_state, source: str) -> None:
        """A ShardError when `opt_state` (arrays or stored metadata) from `source` is not this
        optimizer's: arrays by path and shape (orbax stores optax's named tuples as dicts, by the same
        names and positions)."""
        def shapes(tree):
            return {path_str(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]}

        have, wanted = shapes(opt_state), shapes(self.abstract["opt_state"])
        if have != wanted:
            differ = sorted(set(have) ^ set(wanted)) or sorted(k for k in have if have[k] != wanted[k])
            raise ShardError(f"the optimizer state in {source} is another optimizer's ({len(have)} arrays; this "
                             f"optimizer keeps {len(wanted)}, and they differ at opt_state/{differ[0]})")


def warmup_steps(opt: OptimizerConfig, total_steps: int) -> int:
    """The warmup the schedule uses: opt.warmup_steps, cut to total_steps - 1 so the cosine has a step."""
    return min(opt.warmup_steps, max(total_steps - 1, 0))


def schedule_args(opt: OptimizerConfig, total_steps: int) -> dict:
    """The learning-rate schedule's numbers. The compiled step takes them as arguments, not as constants
    of its program, so a run with another --steps or lr reads the same cached program."""
    warmup = warmup_steps(opt, total_steps)
    return {"peak": np.float32(opt.lr), "end": np.float32(opt.lr * opt.min_lr_ratio),
            "warmup": np.int32(warmup), "decay": np.int32(max(total_steps, warmup + 1))}


def warmup_cosine(args: dict) -> optax.Schedule:
    """optax.warmup_cosine_decay_schedule's curve from `schedule_args`, in jnp arithmetic only, so its
    numbers may be traced: linear from 0 to `peak` over `warmup` updates, then a cosine down to `end` at
    `decay`, and `end` after."""
    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warmup, decay = jnp.asarray(args["warmup"], jnp.float32), jnp.asarray(args["decay"], jnp.float32)
        peak, end = args["peak"], args["end"]
        rising = peak * count / jnp.maximum(warmup, 1.0)
        done = jnp.clip(count - warmup, 0.0, decay - warmup) / (decay - warmup)
        falling = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * done))
        return jnp.where(count < warmup, rising, falling)

    return schedule


def make_optimizer(opt: OptimizerConfig, total_steps: int, model: ModelConfig | None = None):
    """AdamW (no decay on norms or vectors), or with opt.name "muon" Muon on `model`'s weight matrices and
    that AdamW on the rest (shard.training.optimizers); warmup + cosine schedule, global-norm clipping."""
    return optimizer_with(opt, schedule_args(opt, total_steps), model)


def optimizer_with(opt: OptimizerConfig, args: dict, model: ModelConfig | None = None):
    """make_optimizer's (tx, schedule) with the schedule's numbers `args` (schedule_args' or traced)."""
    schedule = warmup_cosine(args)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda p, x: x.ndim >= 2 and "norm" not in path_str(p), params)

    adamw = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=decay_mask)
    if opt.name == "muon":
        if model is None:
            raise ShardError("optimizer.name=muon needs the model config: which weights are its matrices")
        from shard.training.optimizers import muon

        adamw = muon(opt, model, schedule, adamw)
    return optax.chain(optax.clip_by_global_norm(opt.grad_clip), adamw), schedule


def _init_fn(model_cfg: ModelConfig, tx, seed: int, lora: LoraConfig | None = None, fp8_delayed: tuple = ()):
    def init():
        params = nnx.to_pure_dict(nnx.state(models.build(model_cfg, seed=seed, lora=lora)))
        trained = params
        if lora is not None:
            from shard.training.lora import split

            trained = split(params)[0]
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(trained)}
        if model_cfg.router_bias:
            state["router_bias"] = router_bias_init(model_cfg)
        if fp8_delayed:
            state["fp8"] = fp8_histories_init(model_cfg, fp8_delayed)
        return state

    return init


def fp8_histories_init(model_cfg: ModelConfig, paths) -> dict:
    """The amax histories of the fp8_delayed weights at the start: for weight `layers/wq`,
    ["layers"]["wq"] = {"x", "w", "g"} (activation, weight, gradient), each (L, AMAX_HISTORY) float32
    zeros (an empty history: the first step scales by its own amaxes). Beside the params in the state,
    like the router bias: no gradient of their own, no optimizer state; replicated (a few numbers a layer)."""
    shapes = model_params(model_cfg)
    out: dict = {}
    for path in sorted(paths):
        stack, name = path.rsplit("/", 1)
        node = out
        for key in stack.split("/"):
            node = node.setdefault(key, {})
        node[name] = {k: jnp.zeros((shapes[path].shape[0], AMAX_HISTORY), jnp.float32) for k in ("x", "w", "g")}
    return out


def placed_fp8_histories(spec: StateSpec) -> dict:
    """Empty amax histories in their shardings, for a state restored from a checkpoint saved without them."""
    return jax.device_put(fp8_histories_init(spec.model, spec.fp8_delayed), spec.shardings["fp8"])


def router_bias_init(model_cfg: ModelConfig) -> jax.Array:
    """The balancing bias at the start (model.router_bias_update): (L, E) float32 zeros. It lives in the
    state beside the params, not among them: no gradient, no optimizer state; replicated (L E numbers,
    read whole by every token's top-k)."""
    return jnp.zeros((model_cfg.router_bias_layers, model_cfg.n_experts), jnp.float32)


def placed_router_bias(spec: StateSpec, bias=None) -> dict:
    """{"router_bias": `bias` (on the host; None: zeros) in its sharding} where the spec's state holds
    one, else {}: for a state made from params alone (--init-from, import-hf) or read from a checkpoint
    saved without it."""
    if "router_bias" not in spec.abstract:
        return {}
    if bias is None:
        return {"router_bias": jax.device_put(router_bias_init(spec.model), spec.shardings["router_bias"])}
    place_router_bias(bias, spec)  # its shape checked
    return {"router_bias": jax.device_put(np.asarray(bias, np.float32), spec.shardings["router_bias"])}


def placed_extras(spec: StateSpec, bias=None) -> dict:
    """The state's entries beside step, params and optimizer state, where the spec's state holds them: the
    router bias (`bias`, or zeros) and fp8_delayed's amax histories (empty), for a state made from params
    alone (--init-from, import-hf)."""
    out = placed_router_bias(spec, bias)
    if "fp8" in spec.abstract:
        out["fp8"] = placed_fp8_histories(spec)
    return out


def place_router_bias(bias, spec: StateSpec) -> jax.Array | None:
    """A router bias read on the host (a checkpoint's: shard.run.weights.load_with_router_bias) placed
    replicated on the spec's mesh for evaluation or generation; None (none saved) stays None, and
    experts are chosen by their scores alone, as a zero bias would."""
    if bias is None:
        return None
    want = (spec.model.router_bias_layers, spec.model.n_experts)
    if not spec.model.n_experts or np.shape(bias) != want:
        raise ShardError(f"the router bias has shape {np.shape(bias)}, but the model chooses among "
                         f"{spec.model.n_experts} expert(s) in {spec.model.router_bias_layers} layer(s)")
    replicated = NamedSharding(spec.shardings["step"].mesh, PartitionSpec())
    return jax.device_put(np.asarray(bias, np.float32), replicated)


def state_spec(model_cfg: ModelConfig, opt: OptimizerConfig, total_steps: int, layout: Layout, *,
               tx: optax.GradientTransformation | None = None, schedule: optax.Schedule | None = None,
               lora: LoraConfig | None = None) -> StateSpec:
    """Shapes, logical axes and shardings of the whole train state, without allocating it. The
    optimizer is `make_optimizer(opt, total_steps)`'s, or an optax `tx` of one's own with the
    `schedule` its learning rate follows (what the step reports as `lr`); its state is sharded like
    the parameters it mirrors. `lora` with a rank: adapters beside the base weights, which are frozen
    (the optimizer state mirrors the adapters alone)."""
    lora = lora if lora is not None and lora.rank else None
    abstract_model = nnx.eval_shape(lambda: models.build(model_cfg, lora=lora))
    graphdef, model_state = nnx.split(abstract_model)
    logical = logical_axes_of(model_state, layout.regex_rules)
    args, optimizer_from = {}, None
    if tx is None:
        args = schedule_args(opt, total_steps)
        optimizer_from = lambda a: optimizer_with(opt, a, model_cfg)  # noqa: E731
        tx, schedule = optimizer_from(args)
    elif schedule is None:
        raise ShardError("state_spec: an optimizer of one's own (tx) needs the schedule its learning rate "
                         "follows (optax.constant_schedule(lr) for a constant one)")
    fp8_delayed = tuple(sorted(p for p, r in layout.precision.items() if r == DELAYED))
    abstract = jax.eval_shape(_init_fn(model_cfg, tx, 0, lora, fp8_delayed))
    p_shardings = param_shardings(abstract["params"], logical, layout)
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    shardings = {
        "step": replicated,
        "params": p_shardings,
        "opt_state": like_params(abstract["opt_state"], abstract["params"], p_shardings, layout.mesh),
    }
    if "router_bias" in abstract:
        shardings["router_bias"] = replicated
    if "fp8" in abstract:
        shardings["fp8"] = jax.tree.map(lambda _: replicated, abstract["fp8"])
    return StateSpec(graphdef, abstract, shardings, logical, tx, schedule, model_cfg, args, optimizer_from, lora,
                     opt.qk_clip, fp8_delayed)


# The init runs once, so on CPU it is compiled without LLVM's optimisations: the same numbers, in a
# fraction of the compile time (tiny model on fsdp_tp:4x2: 12.6 s -> 1.7 s).
_CPU_INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def compile_init(spec: StateSpec, model_cfg: ModelConfig, seed: int):
    """The compiled init: call it to create parameters and optimizer state in their shardings."""
    if spec.model is not None and model_cfg != spec.model:  # params of other shapes than the spec's
        raise ShardError("init: the model config differs from the one the state spec was built with")
    lowered = jax.jit(_init_fn(model_cfg, spec.tx, seed, spec.lora, spec.fp8_delayed),
                      out_shardings=spec.shardings).lower()
    on_cpu = next(iter(jax.tree.leaves(spec.shardings))).mesh.devices.flat[0].platform == "cpu"
    return lowered.compile(compiler_options=_CPU_INIT_COMPILER_OPTIONS if on_cpu else None)


def init_state(spec: StateSpec, model_cfg: ModelConfig, seed: int) -> dict:
    """Parameters and optimizer state created directly in their shardings."""
    return compile_init(spec, model_cfg, seed)()
