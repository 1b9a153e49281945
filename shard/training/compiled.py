"""The train step compiled ahead of time from abstract shapes (nothing is allocated), and what XLA's memory
analysis says it needs per device. The loop runs this compiled step; `shard inspect --compiled` and the
planner's checks read it."""

from shard.config.train import TrainConfig
from shard.sharding.rules import Layout


def lower_step(cfg: TrainConfig, layout: Layout, spec=None):
    """The train step for this config and layout (and state `spec`, built here when not given), lowered
    from abstract shapes only."""
    from shard.training.state import state_spec
    from shard.training.step import abstract_batch, abstract_schedule_inputs, jit_train_step

    spec = spec or state_spec(cfg.model, cfg.optimizer, cfg.steps, layout, lora=cfg.lora)
    packed = cfg.data.packing == "packed" or cfg.task == "sft"  # sft packs conversations
    batch = abstract_batch(layout, cfg.data.batch, cfg.data.seq_len, packed=packed, loss_mask=cfg.task != "pretrain")
    state = spec.abstract_with_shardings()
    if cfg.task == "grpo":  # the rollout's arrays come as a third argument
        from shard.training.grpo import jit_grpo_step, rollout_shapes

        jitted = jit_grpo_step(spec, layout, cfg.grpo, cfg.guard)
        return jitted.lower(state, batch, rollout_shapes(layout, cfg), abstract_schedule_inputs(spec, layout))
    if cfg.task == "dpo":  # the reference weights come as a fourth argument
        from shard.training.dpo import jit_dpo_step

        jitted = jit_dpo_step(spec, layout, cfg.dpo.beta, cfg.guard)
        frozen = {} if cfg.lora.rank else state["params"]  # with LoRA the reference is the state's base
        return jitted.lower(state, batch, abstract_schedule_inputs(spec, layout), frozen)
    jitted = jit_train_step(spec, layout, cfg.data.microbatches, cfg.guard, cfg.pipeline)
    return jitted.lower(state, batch, abstract_schedule_inputs(spec, layout))


def compile_step(cfg: TrainConfig, layout: Layout, spec=None, compiler_options: dict | None = None):
    """The AOT-compiled train step (`lower_step`'s); `compiler_options` override XLA_FLAGS for this compile."""
    return lower_step(cfg, layout, spec).compile(compiler_options)


def memory_of(compiled) -> dict[str, int]:
    """Per-device bytes from XLA's memory analysis. On CPU `peak_memory_in_bytes` leaves out the
    temporaries, so the total is arguments + temporaries + outputs - aliased (donated state)."""
    m = compiled.memory_analysis()
    out = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
           "temporaries": int(m.temp_size_in_bytes), "aliased": int(m.alias_size_in_bytes)}
    out["total"] = out["arguments"] + out["temporaries"] + out["outputs"] - out["aliased"]
    return out
