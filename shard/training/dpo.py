"""Direct preference optimisation (task = "dpo"; Rafailov et al. 2023): a pure loss over pairs of
sequences and the jitted step around it.

A batch holds pairs in consecutive rows (chosen, rejected); a sequence's log-probability is the sum
over its trained targets (`target_mask`: the completion's assistant tokens). With the policy's log-
probabilities pi and the reference model's ref, each pair's reward is beta * (pi - ref) and its loss
-log sigmoid(reward_chosen - reward_rejected). The reference's are computed in the same step from
frozen weights (`reference_params`), without gradients.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from shard.config.train import GuardConfig
from shard.errors import ShardError
from shard.models import llama
from shard.models.lora import adapting
from shard.sharding.rules import Layout, activation_layout
from shard.training import lora
from shard.training.state import StateSpec, compile_init
from shard.training.step import (batch_sharding, context_order, make_step_parts, packing_of, pipeline_stages,
                                 schedule_inputs, target_mask)

# The step metrics DPO adds to the loss (means over the batch's pairs).
DPO_METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "accuracy")


def sequence_logps(cfg, layout: Layout, params: dict, batch: dict, router_bias=None) -> tuple[jax.Array, dict]:
    """(B,) summed log-probabilities of each row's trained targets, and the forward's MoE statistics."""
    batch, zigzag = context_order(batch, layout, cfg)
    logits_btv, moe = llama.forward(cfg, params, batch["inputs"], zigzag, **packing_of(batch), router_bias=router_bias)
    logits_btv = logits_btv.astype(jnp.float32)
    logz_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    target_bt = jnp.take_along_axis(logits_btv, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum((target_bt - logz_bt) * target_mask(batch), axis=1), moe


def dpo_terms(policy_b: jax.Array, reference_b: jax.Array, beta: float) -> tuple[jax.Array, dict]:
    """(the summed loss over pairs, the metrics as means over pairs) of sequence log-probabilities (B,),
    rows 2k and 2k + 1 the chosen and rejected sequence of pair k."""
    rewards_p2 = beta * (policy_b - reference_b).reshape(-1, 2)  # (pairs, chosen|rejected)
    margin_p = rewards_p2[:, 0] - rewards_p2[:, 1]
    loss = -jnp.sum(jax.nn.log_sigmoid(margin_p))
    metrics = {"reward_chosen": jnp.mean(rewards_p2[:, 0]), "reward_rejected": jnp.mean(rewards_p2[:, 1]),
               "reward_margin": jnp.mean(margin_p), "accuracy": jnp.mean((margin_p > 0).astype(jnp.float32))}
    return loss, metrics


def reference_params(state: dict, frozen: dict) -> dict:
    """The reference model's weights: the frozen copy of the weights the run started from; with LoRA
    (`frozen` empty) the base weights of the state with the adapters left out, so the run holds no
    second copy of the model."""
    if frozen:
        return frozen
    return lora.split(state["params"])[1]


def jit_dpo_step(spec: StateSpec, layout: Layout, beta: float, guard: GuardConfig | None = None):
    """The jitted `(state, batch, args, frozen) -> (state, metrics)`: `frozen` the reference weights
    (`reference_params`), with the params' shardings; `state` is donated."""
    if pipeline_stages(layout) > 1:
        raise ShardError("task dpo does not run through a pipeline (a mesh with a stage axis) yet; use another mesh")
    cfg = spec.model
    _, apply = make_step_parts(spec, layout, 1, guard)
    adapters = spec.lora is not None  # state_spec leaves it None at rank 0

    def loss_fn(params, batch, reference_b, router_bias):
        policy_b, moe = sequence_logps(cfg, layout, params, batch, router_bias)
        loss, metrics = dpo_terms(policy_b, reference_b, beta)
        return loss, (metrics, moe)

    grad_fn = lora.grad_of_trained(spec, loss_fn)

    def step(state, batch, args, frozen):
        router_bias = state.get("router_bias")
        with activation_layout(layout), adapting(spec.lora, lora.dropout_key(state["step"])):
            reference_b, _ = sequence_logps(cfg, layout, reference_params(state, frozen), batch, router_bias)
            reference_b = jax.lax.stop_gradient(reference_b)
            (loss, (metrics, moe)), grads = grad_fn(state["params"], batch, reference_b, router_bias)
        pairs = jnp.asarray(batch["inputs"].shape[0] // 2, jnp.float32)
        new_state, out = apply(state, grads, loss, pairs, moe, args)
        return new_state, out | metrics

    replicated = NamedSharding(layout.mesh, PartitionSpec())
    frozen_shardings = {} if adapters else spec.shardings["params"]
    return jax.jit(step, in_shardings=(spec.shardings, batch_sharding(layout), replicated, frozen_shardings),
                   out_shardings=(spec.shardings, replicated), donate_argnums=0)


def frozen_reference(spec: StateSpec, state: dict, start_step: int, seed: int, reference=None) -> dict:
    """The reference weights of a DPO run: at its first step a copy of the weights it starts from; on a
    resume `reference(spec)` (the init_from weights, as a Restored), else the seed's fresh init; with LoRA
    none ({}): the reference is the state's own base weights (`reference_params`)."""
    if spec.lora is not None and spec.lora.rank:
        return {}
    if start_step == 0:
        return jax.tree.map(lambda x: x.copy(), state["params"])  # its own buffers: the state is donated
    if reference is not None:
        return reference(spec).state["params"]
    return compile_init(spec, spec.model, seed)()["params"]


def with_reference(step, spec: StateSpec, layout: Layout, frozen: dict):
    """`step(state, batch, args, frozen)` as `(state, batch) -> (state, metrics)`."""
    args = schedule_inputs(spec, layout)
    return lambda state, batch: step(state, batch, args, frozen)
