"""Post-training configuration: LoRA's adapters, DPO's preference loss and GRPO's policy loss and
rewards, each a frozen dataclass with the checks of its own keys (TrainConfig holds one of each).
"""

import math
from dataclasses import dataclass

from shard.config.model import ModelConfig
from shard.errors import ShardError

# The weights LoRA adapts: every matrix of a dense layer (shard.config.params.dense_layer_params).
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA (docs/finetuning.md): beside each targeted weight W of every layer, adapters A (in -> rank)
    and B (rank -> out, zero at the start), and W x + (alpha / rank) * dropout(x) A B in its place; the
    base weights are frozen and the optimizer holds the adapters alone. rank 0: off."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("wq", "wv")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def problems(self, model: ModelConfig) -> list[str]:
        if not 0 <= self.rank < 2**31:
            return [f"lora.rank must be 0 (off) or a positive rank below 2**31, got {self.rank}"]
        out = []
        if not 0 <= self.dropout < 1:
            out.append(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not 0 < self.alpha < math.inf:
            out.append(f"lora.alpha must be a positive number, got {self.alpha}")
        if not self.rank:
            if tuple(self.targets) != LoraConfig.targets:  # said, rather than trained without LoRA
                out.append(f"lora.targets is {','.join(self.targets) or 'empty'} but lora.rank is 0, which turns "
                           "LoRA off; set lora.rank (8, say), or leave lora.targets out")
            return out
        if not self.targets:
            out.append(f"lora.targets names no weight; name some of {', '.join(LORA_TARGETS)}")
        sides = _lora_sides(model)
        for t in self.targets:
            if t not in LORA_TARGETS:
                out.append(f"lora.targets: {t!r} names no weight LoRA adapts (one of {', '.join(LORA_TARGETS)})")
            elif model.mla and t in ("wq", "wk", "wv"):
                out.append(f"lora.targets: {t!r} is not a weight of {model.name}'s multi-head latent attention; "
                           "LoRA adapts its output projection (wo) and a dense MLP there")
            elif model.n_experts and t in ("w_gate", "w_up", "w_down"):
                out.append(f"lora.targets: {t!r} is an expert weight of {model.name} (mixture of experts); "
                           "LoRA adapts the attention weights there (wq, wk, wv, wo)")
            elif self.rank > min(sides[t]):
                out.append(f"lora.rank {self.rank} is above what {t} ({sides[t][0]} -> {sides[t][1]} in {model.name}) "
                           f"can use: at most {min(sides[t])}, where its adapters already make a full-rank update")
        if model.dense_layers:
            out.append(f"lora with model.dense_layers={model.dense_layers} is not supported yet: its adapters sit "
                       "beside the expert layers' stack only")
        if len(set(self.targets)) != len(self.targets):
            out.append(f"lora.targets names a weight twice: {', '.join(self.targets)}")
        return out


def _lora_sides(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each weight LoRA adapts, heads flattened (shard.config.params's shapes)."""
    q, kv, d, f = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim, model.d_model, model.mlp_dim
    o = model.n_heads * model.v_dim  # the attention's output: v_head_dim wide per head with MLA
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (o, d), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}


@dataclass(frozen=True)
class DpoConfig:
    """Direct preference optimisation (task = "dpo"): `beta` scales the log-probability ratios against
    the reference model (the weights the run starts from). A pair longer than --seq keeps the last
    `max_prompt_tokens` of its prompt (0: half of --seq), and is left out if still too long."""

    beta: float = 0.1
    max_prompt_tokens: int = 0


# grpo.loss_norm: what a step's summed surrogate is divided by (docs/formulas.md#grpo)
LOSS_NORMS = ("token", "sequence", "constant")


@dataclass(frozen=True)
class GrpoConfig:
    """Group relative policy optimisation and its variants (DAPO, Dr. GRPO): each prompt's
    `samples_per_prompt` completions are scored and compared within their group; the loss is PPO's
    clipped surrogate (docs/formulas.md#grpo, shard.training.grpo)."""

    samples_per_prompt: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    updates_per_batch: int = 1  # optimizer steps on each batch of rollouts
    clip_low: float = 0.2  # the ratio is clipped to [1 - clip_low, 1 + clip_high] (DAPO: 0.2, 0.28)
    clip_high: float = 0.2
    loss_norm: str = "token"  # token (DAPO) | sequence (GRPO) | constant (Dr. GRPO): LOSS_NORMS
    kl_beta: float = 0.0  # the k3 KL penalty to the starting weights; 0 skips the reference forward pass
    normalise_advantages: bool = True  # divide by the group's std (false: Dr. GRPO)
    filter_zero_advantage: bool = True  # leave out groups whose rewards are all equal (no signal)
    filter_truncated: bool = False  # leave out completions cut at max_new_tokens (DAPO's overlong filter)
    tis_cap: float = 2.0  # truncated importance sampling: the sampler/trainer weight capped here; 0: off
    # "NAME" or "NAME=WEIGHT": answer | boxed | last_number | format | module:function (shard.training.rewards)
    rewards: tuple[str, ...] = ()
    format_pattern: str = ""  # the regular expression the `format` reward searches a completion for
    # the mesh the sampler lays the params out on (same devices; "": the training mesh), resharded each step
    rollout_mesh: str = ""

    def problems(self) -> list[str]:
        out = [] if self.loss_norm in LOSS_NORMS else [
            f"grpo.loss_norm must be one of {', '.join(LOSS_NORMS)}, got {self.loss_norm!r}"]
        for spec in self.rewards:
            try:
                reward_spec(spec)
            except ShardError as e:
                out.append(str(e))
        return out


def reward_spec(spec: str) -> tuple[str, float]:
    """(name, weight) of one `grpo.rewards` entry, "NAME" (weight 1) or "NAME=WEIGHT"."""
    name, sep, weight = spec.partition("=")
    try:
        value = float(weight) if sep else 1.0
    except ValueError:
        value = math.nan
    if not name.strip() or not math.isfinite(value):
        raise ShardError(f"a reward is NAME or NAME=WEIGHT (a finite number), got {spec!r}")
    return name.strip(), value
