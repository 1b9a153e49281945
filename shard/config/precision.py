"""Matmul precision as rules (docs/performance.md): the `[precision]` table of a config maps parameter
path regexes (as `param_regex` matches them: a full match of `layers/wq`, `dense_layers/w_up`, ...) to
a recipe, and `precision.default` gives one to every matmul weight that peers run in FP8 by default
(attention projections and the dense MLP). Embeddings, norms, the router, the experts and the head stay
in the compute dtype. Pure data: which weight runs which recipe, decided before JAX starts.
"""

import re

from shard.config.params import model_params
from shard.errors import ShardError

BF16 = "bf16"  # the model's compute dtype (bfloat16 on accelerators): no FP8
DELAYED = "fp8_delayed"
RECIPES = (BF16, "fp8_tensorwise", "fp8_rowwise", DELAYED)
# Recipes with one scale per weight: a weight is quantized where it is stored and gathered (FSDP) as
# float8, its amax one scalar reduced over the shards. Rowwise's backward requantizes the weight along
# other dims than its forward, so it gathers the weight in the compute dtype.
GATHERED = ("fp8_tensorwise", DELAYED)
EXPERT_RECIPE = "fp8_tensorwise"  # the one recipe of a mixture of experts' grouped matmuls
AMAX_HISTORY = 16  # fp8_delayed: the steps of amaxes a scale is taken from (their largest), as TransformerEngine's
# The weights of a dense layer's matmuls: the attention projections and the gated MLP
MATMUL_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def expert_weights(model) -> list[str]:
    """The paths of a mixture of experts' expert stacks (w_gate, w_up, w_down of its MoE stacks): their
    grouped matmuls run in FP8 where a rule names them, `fp8_tensorwise` only (shard.models.fp8.
    fp8_ragged_dot); `precision.default` leaves them in the compute dtype, as peers' defaults do."""
    if not model.n_experts:
        return []
    return [path for path in model_params(model) if path.rpartition("/")[0] in ("layers", "mtp/layers")
            and path.rpartition("/")[2] in ("w_gate", "w_up", "w_down")]


def fp8_weights(model) -> list[str]:
    """The paths of the weights whose matmuls `precision.default` runs in FP8 in this model: the attention
    projections (not multi-head latent attention's) and the dense MLPs, in every stack (`layers`,
    `dense_layers`, `mtp/layers`); a mixture of experts' MLP weights are its experts (`expert_weights`)."""
    out = []
    for path in model_params(model):
        stack, _, name = path.rpartition("/")
        if stack not in ("layers", "dense_layers", "mtp/layers") or name not in MATMUL_WEIGHTS:
            continue
        moe_stack = model.n_experts and stack != "dense_layers"
        if (name.startswith("w_") and moe_stack) or (model.mla and name in ("wq", "wk", "wv", "wo")):
            continue
        out.append(path)
    return out


def parse_precision(table, where: str = "precision") -> dict[str, str]:
    """Validate a `[precision]` table from TOML or `--set`: `default` and regex keys, recipe values."""
    if not isinstance(table, dict):
        raise ShardError(f"{where}: expected a table of parameter path regex = recipe (and default = recipe)")
    out = {}
    for key, recipe in table.items():
        if not isinstance(recipe, str) or recipe not in RECIPES:
            raise ShardError(f"{where}.{key}: unknown recipe {recipe!r} (one of {', '.join(RECIPES)})")
        if key != "default":
            try:
                re.compile(key)
            except re.error as e:
                raise ShardError(f"{where}: {key!r} is not a regular expression ({e})") from None
        out[key] = recipe
    return out


def weight_recipes(precision: dict[str, str], model) -> dict[str, str]:
    """The recipe of every weight not in the compute dtype, by path: the first rule that fully matches
    it, else `precision.default`. A rule that decides no FP8-capable weight (a typo, a norm, the
    embedding, a shadowed pattern) is a ShardError."""
    rules = [(rx, r) for rx, r in precision.items() if rx != "default"]
    default = precision.get("default", BF16)
    paths, experts = fp8_weights(model), expert_weights(model)
    out, decided = {}, set()
    for path in paths + experts:
        i = next((i for i, (rx, _) in enumerate(rules) if re.fullmatch(rx, path)), None)
        if i is not None:
            decided.add(i)
        recipe = (BF16 if path in experts else default) if i is None else rules[i][1]
        if path in experts and recipe not in (BF16, EXPERT_RECIPE):
            raise ShardError(f"precision rule {rules[i][0]!r} puts the experts' {path} in {recipe}: their grouped "
                             f"matmuls run in {EXPERT_RECIPE} only (one scale per expert stack)")
        if recipe != BF16:
            out[path] = recipe
    for i, (rx, _) in enumerate(rules):
        if i not in decided:
            raise ShardError(f"precision rule {rx!r} decides no matmul weight of {model.name} "
                             f"(a full match of one of: {', '.join(paths + experts) or 'none'}; an earlier rule wins "
                             "where two match; embeddings, norms, router and head stay in the compute dtype)")
    return out


def fp8_gathered(precision: dict[str, str], model) -> frozenset[str]:
    """The weights (by path) whose FSDP all-gathers move float8 bytes under the `[precision]` rules."""
    return gathered_weights(weight_recipes(precision, model), model)


def gathered_weights(recipes: dict[str, str], model) -> frozenset[str]:
    """Of resolved recipes (weight_recipes: path -> recipe), the weights whose FSDP all-gathers move
    float8 bytes: those of a GATHERED recipe but the experts, which are gathered in the compute dtype and
    quantized where they run. The model quantizes these before their gather (shard.models.fp8.
    stack_gathered); the cost model counts their gathers at a byte an element."""
    experts = set(expert_weights(model))
    return frozenset(p for p, r in recipes.items() if r in GATHERED and p not in experts)


def delayed_problems(cfg) -> list[str]:
    """What fp8_delayed (amax histories updated by the train step's gradient pass) does not run with yet:
    LoRA, DPO and GRPO (other gradient paths), the MPI bridge (it sums gradients across processes, and the
    histories are not gradients) and multi-token prediction's layers (their histories are not kept)."""
    if DELAYED not in weight_recipes(cfg.precision, cfg.model).values():
        return []
    what = ("lora.rank" if cfg.lora.rank else f"task {cfg.task}" if cfg.task in ("dpo", "grpo") else "cluster.cross_host=mpi"
            if cfg.cluster.cross_host == "mpi" else "model.mtp_depth" if cfg.model.mtp_depth else "")
    return [f"precision recipe fp8_delayed does not run with {what} yet; use fp8_tensorwise or fp8_rowwise"] if what else []
