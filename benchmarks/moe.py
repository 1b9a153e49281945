"""Mixture of experts on 8 simulated devices: step time and tokens/s of dropless routing (grouped matmuls)
against the capacity form (capacity_factor 1.25) and a dense model of the same active parameters, on
the `ep` (data=2, expert=4) and `fsdp` layouts; and the expert axis' all-to-all bytes per device per
step against the static-shape minimum, what a ragged all-to-all sends with balanced routing, and what it
sends on the step's own routing (the `expert_rows_sent` metric; shard.measure.costs, docs/formulas.md).
XLA:CPU has no ragged all-to-all: the bytes moved here are the padded exchange's.

Times are medians of timed steps after a warm-up on simulated CPU devices, which share the host's
cores (and the host may be shared with other work): they compare the forms' work on CPU, where
`ragged_dot` lowers to a masked dense matmul over every expert, not GPU throughput.

The `deepseek-style` and `mixtral-style` forms put DeepSeek-V3's attention and routing (MLA, group-limited
sigmoid routing, a shared expert) against Mixtral's (grouped-query attention, a softmax top-k) at the same
active experts; `active` is the parameters a token's matmuls use (MFU's N, shard.config.flops.matmul_params).

    python benchmarks/moe.py [--model moe-fine-tiny] [--steps 5] [--batch 16] [--seq 64] [--layouts ep,fsdp]
                             [--forms dropless,deepseek-style,mixtral-style]
"""

import argparse
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")


from shard import config, prepare
from shard.config.flops import matmul_params
from shard.config.presets import PRESETS
from shard.measure import costs
from shard.measure.analysis import analyze
from shard.sharding.layout import make_layout
from shard.sharding.mesh import parse_mesh
from shard.testing import median_step_seconds


def forms(model: str) -> dict[str, dict]:
    """The --set items of each form: dropless, capacity 1.25, a dense SwiGLU as wide as the k routed
    experts plus the shared ones (the same active parameters but the router), and the two routings
    DeepSeek-V3 and Mixtral stand for at the same active experts: `mixtral-style` (a softmax over all
    experts, top k + shared of them, no shared expert, grouped-query attention) and `deepseek-style`
    (multi-head latent attention with a query latent, sigmoid scores limited to the best half of 4 expert
    groups, scaled by 2.5, the model's shared experts or one, top k)."""
    m = PRESETS[model]
    dense_width = (m.experts_per_token + m.n_shared_experts) * m.mlp_dim
    out = {"dropless": {"model.moe_routing": "dropless"},
           "capacity 1.25": {"model.moe_routing": "capacity", "model.capacity_factor": 1.25},
           f"dense (mlp {dense_width})": {"model.n_experts": 0, "model.n_shared_experts": 0,
                                          "model.router_bias_update": 0, "model.mlp_dim": dense_width}}
    mla_off = {"model.kv_lora_rank": 0, "model.q_lora_rank": 0, "model.qk_nope_head_dim": 0,
               "model.qk_rope_head_dim": 0, "model.v_head_dim": 0}
    H = m.qk_nope_head_dim or m.head_dim
    shared = max(m.n_shared_experts, 1)
    out["mixtral-style"] = mla_off | {
        "model.moe_routing": "dropless", "model.router_scores": "softmax", "model.router_normalize": True,
        "model.routed_scale": 1.0, "model.router_groups": 1, "model.router_topk_groups": 1,
        "model.n_shared_experts": 0, "model.experts_per_token": m.experts_per_token + shared, "model.head_dim": H}
    out["deepseek-style"] = {
        "model.moe_routing": "dropless", "model.router_scores": "sigmoid", "model.router_normalize": True,
        "model.routed_scale": 2.5, "model.router_groups": 4, "model.router_topk_groups": 2,
        "model.n_shared_experts": shared, "model.n_kv_heads": m.n_heads, "model.q_lora_rank": m.d_model // 2,
        "model.kv_lora_rank": m.d_model // 4, "model.qk_nope_head_dim": H, "model.qk_rope_head_dim": H,
        "model.v_head_dim": H, "model.head_dim": 2 * H}
    return out


def resolve(model: str, mesh: str, sets: dict, batch: int, seq: int):
    items = [f"model.name={model}", f"mesh.spec={mesh}", f"data.batch={batch}", f"data.seq_len={seq}",
             "data.path=synthetic", "steps=100", "optimizer.warmup_steps=1"]
    return config.resolve(config.parse_sets(items + [f"{k}={v}" for k, v in sets.items()]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="moe-fine-tiny")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layouts", default="ep,fsdp", help="comma-separated: ep, fsdp")
    p.add_argument("--forms", default="", help="comma-separated forms to run (their names' first words; "
                                                "default: all)")
    a = p.parse_args()
    print(f"{a.model}, batch {a.batch} x {a.seq}, 8 simulated CPU devices (shared cores: times are noisy)")
    print(f"{'layout':<6} {'form':<18} {'active':>7} {'step ms':>8} {'tokens/s':>9} {'a2a B/dev':>10} "
          f"{'static min':>10} {'ragged min':>10} {'ragged routed':>13}")
    chosen = [f for f in a.forms.split(",") if f]
    for mesh in a.layouts.split(","):
        for label, sets in forms(a.model).items():
            if chosen and label.split()[0] not in chosen:
                continue
            cfg = resolve(a.model, mesh, sets, a.batch, a.seq)
            run = prepare(cfg)
            t = median_step_seconds(run, a.steps)
            active = f"{matmul_params(cfg.model) / 1e6:.3f}M"  # parameters in matmuls per token (MFU's N)
            row = f"{mesh:<6} {label:<18} {active:>7} {t * 1e3:>8.1f} {a.batch * a.seq / t:>9,.0f}"
            m = cfg.model
            if mesh == "ep" and m.n_experts:
                layout = make_layout(cfg, parse_mesh(cfg.mesh.spec))
                moved = sum(c.logical_wire_bytes * c.count for c in analyze(cfg, layout).collectives
                            if c.kind == "all-to-all")
                n, tokens = layout.axis_sizes["expert"], a.batch * a.seq / layout.mesh.size
                row += f" {moved:>10,.0f}"
                if m.moe_routing == "dropless":
                    run.state, metrics = run.step_fn(run.state, run.stream.next())
                    rows = float(metrics["expert_rows_sent"]) / layout.mesh.size  # a token device's, all layers
                    row += (f" {costs.dropless_static_bytes(m, n, tokens, 4):>10,.0f}"
                            f" {costs.dropless_ragged_bytes(m, n, tokens, 4):>10,.0f}"
                            f" {costs.dropless_ragged_bytes(m, n, tokens, 4, rows=rows):>13,.0f}")
            print(row, flush=True)


if __name__ == "__main__":
    main()
