"""`shard plan`, `shard inspect --compiled` and `shard bench collectives` from the command line."""

import dataclasses
import json
import re

import pytest
from typer.testing import CliRunner

from shard.cli.app import app
from shard.hardware import find_hardware, load_hardware
from shard.measure.plan import GIB, layouts, node_split

REFERENCE = ["plan", "--model", "llama-13b-24l", "--devices", "32", "--nodes", "8", "--hardware", "a100-40gb"]


def invoke(*args):
    return CliRunner().invoke(app, list(args))


def test_reference_plan_is_stable():
    r = invoke(*REFERENCE, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    best = doc["layouts"][0]
    assert best["fits"] and best["memory_per_device_bytes"] <= 40 * GIB
    assert doc["best"] == ("shard train --model llama-13b-24l --mesh data=2,fsdp=8,model=2 --batch 64 --seq 2048 "
                           "--set model.remat=full")
    # as fast, less exposed traffic, but predicted at 35.7 of its 36 usable GiB (the model runs up to 7%
    # low): after the layout as fast with room to spare
    meshes = [c["mesh"] for c in doc["layouts"]]
    tight = doc["layouts"][meshes.index("data=4,fsdp=4,model=2")]
    assert meshes.index(tight["mesh"]) in (1, 2) and tight["memory_per_device_bytes"] > 0.93 * 36 * GIB
    assert tight["step_s_no_overlap"] < best["step_s_no_overlap"]
    # tensor parallel stays inside a 4-GPU node; the data-parallel axes cross nodes
    assert best["sizes"]["model"] <= 4 and best["crosses_nodes"]["fsdp"] and not best["crosses_nodes"]["model"]
    # pure data parallel cannot hold 13B parameters with AdamW on 40 GB, and says so
    dp = next(c for c in doc["layouts"] if c["mesh"] == "data=32" and c["remat"] == "full")
    assert not dp["fits"] and "memory" in dp["problems"][0]
    assert all(c["fits"] for c in doc["layouts"][:3])


def test_plan_reports_mfu_as_train_does():
    # one MFU definition: useful work (causal attention at half) over the predicted step, never remat's
    from shard.config.flops import mfu_flops_per_token
    from shard.config.presets import PRESETS
    from shard.measure.plan import predict

    cfg, hw = PRESETS["llama-13b-24l"], find_hardware("a100-40gb", load_hardware())
    for remat in ("none", "full"):
        c = predict(cfg, {"data": 2, "fsdp": 8, "model": 2}, remat, hw, 8, 64, 2048)
        useful = mfu_flops_per_token(cfg, 2048) * 64 * 2048 / 32
        assert c.mfu == pytest.approx(useful / (c.step_s * hw.bf16_tflops * 1e12))


def test_compute_is_taken_at_the_measured_matmul_rate(tmp_path):
    # the roofline took matmuls at the datasheet's peak, so a compute-bound layout read 100% MFU
    from shard.measure.flops import model_flops
    from shard.config.presets import PRESETS
    from shard.measure.plan import predict

    cfg, table = PRESETS["llama-1b"], load_hardware()
    h200 = find_hardware("h200", table)
    assert (h200.bf16_tflops, h200.achieved_tflops) == (989.0, 790.0)
    c = predict(cfg, {"data": 1}, "none", h200, 1, 8, 2048)
    assert c.compute_s == pytest.approx(model_flops(cfg, 8 * 2048, 2048, 1, flash=True) / 790e12)
    assert 0.5 < c.mfu <= 790 / 989 + 1e-9
    # one above the peak is refused in one line
    a100 = find_hardware("a100-80g", table)
    assert a100.achieved_tflops == a100.matmul_tflops == 250.0 < a100.bf16_tflops
    # every shipped entry has a matmul rate below its peak; one without it is taken at 80% of the peak
    assert all(hw.matmul_tflops and hw.matmul_tflops < hw.bf16_tflops for hw in table.values())
    assert dataclasses.replace(a100, matmul_tflops=None).achieved_tflops == pytest.approx(0.8 * 312.0)
    f = tmp_path / "mine.toml"
    f.write_text("[mine]\nbf16_tflops = 100.0\nmatmul_tflops = 120.0\nhbm_gib = 80.0\nhbm_gbps = 3000.0\n"
                 "intra_node_gbps = 400.0\ninter_node_gbps = 50.0\ndevices_per_node = 8\n")
    r = invoke(*REFERENCE, "--hardware-file", str(f), "--hardware", "mine")
    assert r.exit_code == 2 and r.output.strip() == (
        f"error: hardware file {f}: [mine]: matmul_tflops (120) is above the peak bf16_tflops (100)")


def test_fp8_matmuls_are_taken_at_the_fp8_rate():
    """The attention projections and MLPs that precision.default puts in FP8 are planned at fp8_tflops
    (h100: 1979, reached at bf16's 790 / 989 of the peak), the rest of the compute at bf16's rate."""
    from shard.config.presets import PRESETS
    from shard.measure.flops import model_flops
    from shard.measure.plan import plan

    cfg, hw = PRESETS["llama-7b"], find_hardware("h100", load_hardware())
    assert hw.achieved_fp8_tflops == pytest.approx(1979 * 790 / 989)
    bf16, fp8, rows = (plan(cfg, 8, 1, hw, 16, 2048, ("none",), precision={"default": recipe})
                       for recipe in ("bf16", "fp8_tensorwise", "fp8_rowwise"))
    bf16, rows = {c.mesh_spec(): c for c in bf16}, {c.mesh_spec(): c for c in rows}
    for c in fp8:  # the recipe does not change the rate; tensorwise gathers float8, rowwise the compute dtype
        assert c.compute_s == rows[c.mesh_spec()].compute_s
        if c.sizes.get("fsdp", 1) > 1:
            assert c.comm_bytes["fsdp"] < rows[c.mesh_spec()].comm_bytes["fsdp"] == bf16[c.mesh_spec()].comm_bytes["fsdp"]
    per_layer = 2 * cfg.d_model * cfg.n_heads * cfg.head_dim + 2 * cfg.d_model * cfg.n_kv_heads * cfg.head_dim \
        + 3 * cfg.d_model * cfg.mlp_dim  # wq, wo; wk, wv; the gated MLP
    share = 6 * cfg.n_layers * per_layer * 16 * 2048 / model_flops(cfg, 16 * 2048, 2048, flash=True)
    assert 0.9 < share < 1
    for c in (c for c in fp8 if c.sizes.get("context", 1) == 1):  # ring attention scores other keys
        assert c.compute_s == pytest.approx(bf16[c.mesh_spec()].compute_s * (1 - share + share * 989 / 1979))
    assert fp8[0].step_s < 0.6 * bf16[fp8[0].mesh_spec()].step_s  # fsdp=8, compute-bound


def test_remat_is_never_predicted_faster():
    """Remat adds compute and moves no fewer activations; the HBM term counted only those remat keeps,
    so a small model on H100s (HBM-bound) ranked fsdp=4,model=2 with full remat first, at 22% MFU
    against 16% without."""
    from shard.config.presets import PRESETS
    from shard.measure.plan import predict

    hw = find_hardware("h100", load_hardware())
    for sizes in ({"fsdp": 8}, {"fsdp": 4, "model": 2}, {"data": 2, "fsdp": 2, "model": 2}):
        none, full = (predict(PRESETS["small"], sizes, remat, hw, 1, 16, 128) for remat in ("none", "full"))
        assert full.step_s >= none.step_s, sizes


def test_reference_plan_table_names_the_best_command():
    r = invoke(*REFERENCE)
    assert r.exit_code == 0, r.output
    assert "best: shard train --model llama-13b-24l --mesh data=2,fsdp=8,model=2" in r.output


@pytest.mark.parametrize("args, message", [
    (["--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
    (["--devices", "30", "--nodes", "8"], "30 devices cannot form 8 equal nodes"),
    (["--devices", "32", "--nodes", "2"], "16 devices per node, but a a100-40g node holds at most 8"),
    (["--model", "gpt9"], "unknown model 'gpt9'"),
    (["--batch", "0"], "--batch must be positive, got 0"),
    (["--seq", "0"], "--seq must be positive, got 0"),
    (["--devices", "-8"], "--devices must be positive, got -8"),
    (["--top", "-1"], "--top must be 0 or more, got -1"),
    (["--set", "data.batch=7"], "plan takes model.*, optimizer.* and precision.* keys in --set"),
    (["--set", "precision.default=fp8_tensorwise"], "a100-40g has no fp8_tflops (no FP8 tensor cores"),
    (["--set", "precision.layers/wz=fp8_rowwise"], "precision rule 'layers/wz' decides no matmul weight"),
    (["--stages", "4", "--microbatches", "3"], "does not split into 3 microbatches"),
    (["--stages", "4", "--microbatches", "0"], "--microbatches must be 1 or more, got 0"),
    (["--stages", "3"], "--stages 3 does not divide --devices"),
])
def test_bad_plan_input_is_one_line_and_exit_2(args, message):
    base = dict(zip(REFERENCE[1::2], REFERENCE[2::2]))
    base.update(dict(zip(args[::2], args[1::2])))
    r = invoke("plan", *[x for kv in base.items() for x in kv])
    assert r.exit_code == 2, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1


def test_plan_counts_muons_optimizer_state_and_the_latent_cache():
    """DeepSeek-V3 on 256 H100s: AdamW's two moments leave no layout within memory, Muon's one momentum on
    the matrices (AdamW's on the rest) fits one, and the best command trains with Muon; the KV cache line
    gives MLA's latent per token (61 layers of 512 + 64 in bfloat16) beside full keys and values."""
    args = ["plan", "--model", "deepseek-v3", "--devices", "256", "--nodes", "32", "--top", "1"]
    adamw, muon = invoke(*args), invoke(*args, "--set", "optimizer.name=muon")
    assert adamw.exit_code == 1 and muon.exit_code == 0, muon.output
    assert "optimizer state per device on fsdp=32,expert=8: muon 12G (adamw: 23G)" in muon.output
    assert "--set optimizer.name=muon --set model.remat=full" in muon.output
    assert "KV cache: 70,272 bytes per token, latent (MLA); keys and values of all 128 heads: 4,997,120" in muon.output


def test_the_best_command_trains_the_model_that_was_planned():
    """`--set model.*` changes the model planned: the best command passes them on (it dropped them, so the
    command trained the preset), and a remat policy given is the only one planned."""
    r = invoke("plan", "--model", "llama-1b", "--devices", "8", "--set", "model.n_layers=8", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["best"].endswith(" --seq 2048 --set model.n_layers=8 --set model.remat=none")
    table = invoke("plan", "--model", "llama-1b", "--devices", "8", "--set", "model.n_layers=8")
    assert "--seq 2048 --set model.n_layers=8 --set model.remat=none\n" in table.output  # whole, on one line
    pinned = json.loads(invoke("plan", "--model", "llama-1b", "--devices", "8", "--set", "model.remat=full",
                               "--json").stdout)
    assert {c["remat"] for c in pinned["layouts"]} == {"full"} and pinned["best"].endswith("--set model.remat=full")


def test_a_plan_where_nothing_fits_exits_1():
    """The table (or JSON) still prints in full; the status tells a script there is no layout to run."""
    args = ("plan", "--model", "llama-13b-24l", "--devices", "1", "--hardware", "a100-40g")
    r = invoke(*args)
    assert r.exit_code == 1, r.output
    assert "0 of 2 layouts fit" in r.output and r.output.rstrip().endswith(
        "no layout fits: add devices, shorten --seq, or lower --batch")
    as_json = invoke(*args, "--json")
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["best"] is None


def test_a_mixture_of_experts_is_planned_over_an_expert_axis():
    # 8 experts, top 2, of a 7B Llama: 37B parameters on 4 nodes of 8 H100s
    moe = ("--model", "llama-7b", "--set", "model.n_experts=8", "--set", "model.experts_per_token=2")
    r = invoke("plan", *moe, "--devices", "32", "--nodes", "4", "--hardware", "h100", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    best = doc["layouts"][0]
    # the experts split 8 ways inside a node, their all-to-alls over NVLink
    assert best["fits"] and best["sizes"]["expert"] == 8 and not best["crosses_nodes"]["expert"]
    # with data=2,fsdp=2,expert=8 within the 2% tie: compute-bound both, the one with room to spare first
    assert "--mesh fsdp=4,expert=8 " in doc["best"] and "--set model.n_experts=8" in doc["best"]
    second = doc["layouts"][1]
    assert second["mesh"] == "data=2,fsdp=2,expert=8" and second["step_s"] <= 1.02 * best["step_s"]
    assert best["memory_per_device_bytes"] < second["memory_per_device_bytes"]
    assert all(set(c["sizes"]) == {"data", "fsdp", "expert"} for c in doc["layouts"])
    assert doc["warnings"] == ["a mixture of experts is planned over data, fsdp and expert axes only: tensor and "
                               "context parallel have no formula for its layers"]
    text = invoke("plan", "--model", "moe-tiny", "--devices", "8", "--hardware", "cpu", "--seq", "128", "--batch", "16")
    assert text.exit_code == 0, text.output
    # with the table, before the best (it went to stderr, easily missed)
    assert text.stdout.index("warning: a mixture of experts is planned over") < text.stdout.index("best: ")


def test_user_hardware_file(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('[mi300x]\nbf16_tflops = 1307.0\nhbm_gib = 192.0\nhbm_gbps = 5300.0\nintra_node_gbps = 448.0\n'
                 'inter_node_gbps = 50.0\ndevices_per_node = 8\n')
    assert find_hardware("MI300X", load_hardware(f)).hbm_gib == 192.0
    f.write_text("[bad]\nbf16_tflops = 1.0\n")
    r = invoke(*REFERENCE, "--hardware-file", str(f))
    assert r.exit_code == 2 and "missing key(s)" in r.output


@pytest.mark.parametrize("change, message", [
    ('bf16_tflops = "abc"', "[mine]: bf16_tflops must be a positive number, got 'abc'"),
    ("hbm_gbps = 0.0", "hbm_gbps must be a positive number, got 0.0"),
    ("hbm_gib = -80.0", "hbm_gib must be a positive number"),
    ("devices_per_node = 8.5", "devices_per_node must be a positive whole number"),
])
def test_hardware_figures_must_be_positive_numbers(tmp_path, change, message):
    figures = {"bf16_tflops": "1.0", "hbm_gib": "80.0", "hbm_gbps": "3000.0", "intra_node_gbps": "400.0",
               "inter_node_gbps": "50.0", "devices_per_node": "8"}
    key, _, value = change.partition(" = ")
    figures[key] = value
    f = tmp_path / "mine.toml"
    f.write_text("[mine]\n" + "".join(f"{k} = {v}\n" for k, v in figures.items()))
    r = invoke(*REFERENCE, "--hardware-file", str(f), "--hardware", "mine")
    assert r.exit_code == 2, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1
    f.write_bytes(b"\xff\x00")
    assert "is not a text (TOML) file" in invoke(*REFERENCE, "--hardware-file", str(f)).output


def test_layouts_keep_tensor_parallel_in_a_node():
    assert {d["model"] for d in layouts(32, 4)} == {1, 2, 4}
    assert node_split({"data": 2, "fsdp": 8, "model": 2}, 8) == {"data": 2, "fsdp": 4, "model": 1}
    # hosts fill the mesh's own outermost axes, as build_mesh lays them out (it took data first whatever
    # the order, so `--mesh model=2,data=4` on 2 hosts was warned about as data across hosts)
    assert node_split({"model": 2, "data": 4}, 2) == {"model": 2, "data": 1}


def test_plan_counts_activations_in_the_configured_compute_dtype():
    """On a GPU, model.compute_dtype=float32 holds activations at 4 bytes; the plan took 2 whatever it said."""
    import dataclasses

    from shard.config.presets import PRESETS
    from shard.measure.plan import predict

    hw, cfg = find_hardware("h100", load_hardware()), PRESETS["llama-1b"]
    act = {dtype: predict(dataclasses.replace(cfg, compute_dtype=dtype), {"data": 8}, "none", hw, 1, 8,
                           2048).memory["activations"] for dtype in ("auto", "bfloat16", "float32")}
    assert act["auto"] == act["bfloat16"] and act["float32"] > 1.5 * act["bfloat16"]


def test_inspect_compiled_json():
    r = invoke("inspect", "--mesh", "fsdp", "--model", "tiny", "--compiled", "--batch", "8", "--seq", "32", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert {"memory_per_device_bytes", "collectives", "communication_efficiency", "params"} <= set(doc)
    assert doc["memory_per_device_bytes"] > doc["params_bytes_per_device"]
    kinds = {(c["kind"], tuple(c["axes"])) for c in doc["collectives"]}
    assert ("all-gather", ("fsdp",)) in kinds and ("reduce-scatter", ("fsdp",)) in kinds
    assert all({"kind", "axes", "count", "bytes_per_device"} <= set(c) for c in doc["collectives"])
    assert 0.9 <= doc["communication_efficiency"]["fsdp"] <= 1.0 + 1e-3, doc["communication_efficiency"]


def test_inspect_compiled_table(monkeypatch):
    # compiled as users compile it: without XLA:CPU's fusion emitters (the suite's fast flags) the
    # unfused residual adds make tensor parallel's two all-reduces per layer look like one (1.25)
    from shard.measure import analysis
    from shard.testing import AS_USERS_COMPILE

    compile_step = analysis.compile_step
    monkeypatch.setattr(analysis, "compile_step",
                        lambda cfg, layout, spec=None, compiler_options=None: compile_step(cfg, layout, spec, AS_USERS_COMPILE))
    r = invoke("inspect", "--mesh", "2x4", "--model", "tiny", "--compiled", "--batch", "8", "--seq", "32")
    assert r.exit_code == 0, r.output
    out = r.output
    rows = [cells for line in out.splitlines() if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) == 6]
    model = [c for c in rows if c[1] == "model"]
    assert {c[0] for c in model} == {"all-reduce"} and all(int(c[3]) > 0 for c in model)  # tensor parallel
    assert {c[1] for c in rows} == {"model", "data"}
    unit = {"B": 1, "KiB": 2**10, "MiB": 2**20}
    size = lambda text: float(text.split()[0]) * unit[text.split()[1]]  # noqa: E731
    for axis, cells in (("model", model), ("data", [c for c in rows if c[1] == "data"])):
        said = re.search(rf"^axis {axis}: moved ([\d.]+ \w+), analytic minimum [\d.]+ \w+, efficiency [\d.]+$",
                         out, re.M)
        assert said and size(said[1]) == pytest.approx(sum(size(c[4]) for c in cells), abs=6), out  # the rows' sum
    assert re.search(r"^memory per device [\d.]+ [KM]iB \(arguments [\d.]+ [KM]iB \+ temporaries .* model FLOPs/device "
                     r"[\d.e+]+, the compiled step's matmuls [\d.e+]+ \(each loop by its trip count, .* XLA's cost "
                     r"analysis", out, re.M), out  # one line, not cut at 80 columns


def test_bench_collectives_json():
    r = invoke("bench", "collectives", "--mesh", "2x4", "--kind", "all-reduce", "--kind", "all-gather",
               "--min-size", "1024", "--max-size", "4096", "--iters", "1", "--json")
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.output.splitlines() if line.startswith("{")]
    assert {(x["kind"], x["axis"]) for x in rows} == {(k, a) for k in ("all-reduce", "all-gather")
                                                       for a in ("data", "model")}
    ar = next(x for x in rows if x["kind"] == "all-reduce" and x["axis"] == "model" and x["size_bytes"] == 4096)
    assert ar["busbw_gbps"] == pytest.approx(ar["algbw_gbps"] * 2 * 3 / 4, rel=1e-3)


def test_bench_says_when_it_measures_another_size_than_asked():
    """A float32 per device at least: 3 bytes over 2 devices is 8; it was measured in silence."""
    r = invoke("bench", "collectives", "--mesh", "2x4", "--kind", "all-reduce", "--min-size", "3", "--max-size", "5",
               "--iters", "1", "--json")
    assert r.exit_code == 0, r.output
    assert "sizes are rounded to whole float32 elements, at least one per device of the axis: 3 B asked, 8 B " \
           "measured (all-reduce over data)" in r.output
    assert r.output.count("sizes are rounded") == 1


def test_bench_rejects_no_timed_runs():
    r = invoke("bench", "collectives", "--mesh", "4", "--iters", "0")
    assert r.exit_code == 2 and "--iters must be positive" in r.output, r.output


def test_bench_rejects_unknown_collective():
    r = invoke("bench", "collectives", "--mesh", "2x4", "--kind", "broadcast")
    assert r.exit_code == 2 and "unknown collective 'broadcast'" in r.output


def test_bench_on_a_mesh_without_traffic_is_an_error():
    r = invoke("bench", "collectives", "--mesh", "1x1")
    assert r.exit_code == 2 and "mesh data=1,model=1 has no axis of size > 1: nothing to measure" in r.output, r.output


def test_no_fitting_layout_is_ranked_ahead_of_one_more_than_two_percent_faster():
    doc = json.loads(invoke(*REFERENCE, "--json").output)
    fitting = [c["step_s"] for c in doc["layouts"] if c["fits"]]
    assert len(fitting) > 5
    assert all(a <= b * 1.0201 for i, a in enumerate(fitting) for b in fitting[i + 1:])


def test_a_layout_fits_in_ninety_percent_of_memory():
    """A tenth of HBM is left to the runtime, communication buffers and fragmentation."""
    import dataclasses

    from shard.config.presets import PRESETS
    from shard.measure.plan import predict

    hw, cfg = find_hardware("a100-40gb", load_hardware()), PRESETS["llama-1b"]
    total = predict(cfg, {"fsdp": 8}, "full", hw, 1, 8, 2048).memory["total"]
    for share, fits in ((0.95, False), (0.85, True)):
        c = predict(cfg, {"fsdp": 8}, "full", dataclasses.replace(hw, hbm_gib=total / share / GIB), 1, 8, 2048)
        assert c.fits == fits and any("> 90% of" in p for p in c.problems) != fits
        # every number of the problem with its unit
        assert fits or re.fullmatch(r"memory \d+\.\d GiB > 90% of \d+(\.\d+)? GiB", c.problems[0]), c.problems


def test_a_batch_that_does_not_split_over_the_devices_is_planned_context_parallel():
    """100 sequences don't split 8 ways, and 8 is the fewest data-parallel devices that hold llama-7b on 64
    H100s with tensor parallel inside a node: splitting each sequence in two (ring attention) does."""
    r = invoke("plan", "--model", "llama-7b", "--devices", "64", "--nodes", "8", "--batch", "100", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    best = doc["layouts"][0]
    assert best["sizes"]["context"] == 2 and best["comm_bytes_per_axis"]["context"] > 0
    assert doc["best"].startswith("shard train --model llama-7b --mesh ") and "context=2," in doc["best"]
    # where the batch splits, context parallel is not chosen: its ring attention runs in float32
    r = invoke("plan", "--model", "llama-7b", "--devices", "64", "--nodes", "8", "--batch", "128", "--json")
    assert json.loads(r.output)["layouts"][0]["sizes"]["context"] == 1


def test_context_parallel_layouts_split_the_sequence():
    assert {d["context"] for d in layouts(8, 8, seq_len=12)} == {1, 2, 4}  # not 8: 12 does not split 8 ways
    assert all("context" not in d for d in layouts(8, 8))
    from shard.measure import costs
    from shard.config.presets import PRESETS

    problems = costs.LayoutShape.of(context=8).divisibility_problems(PRESETS["tiny"], 8, seq_len=12)
    assert problems == ["sequence length 12 does not split over 8 context-parallel devices"]


def test_a_batch_no_layout_can_split_is_named_as_the_reason():
    """It said "add devices, shorten --seq, or lower --batch" where 100 sequences don't split 8 ways (and,
    at 2047 tokens, no sequence splits either)."""
    r = invoke("plan", "--model", "llama-7b", "--devices", "64", "--nodes", "8", "--batch", "100", "--seq", "2047")
    assert r.exit_code == 1 and ("no layout fits: --batch 100 splits over the data-parallel devices of none of them "
                                 "(the fewest are 8); use a multiple of 8") in r.output


def test_plan_ranks_the_pipeline_schedules():
    """`plan --stages 4`: every schedule the 24 layers allow, smallest bubble first, the bubble read from
    each schedule's table equal to its formula; zero-bubble keeps 1F1B's activations at a third of its
    bubble, interleaved V = 2 about half (3/19 against 3/11), GPipe keeps every microbatch's."""
    r = invoke(*REFERENCE, "--stages", "4", "--microbatches", "8", "--json")
    assert r.exit_code == 0, r.output
    rows = {(o["schedule"], o["virtual_stages"]): o for o in json.loads(r.output)["schedules"]}
    assert set(rows) == {("zero_bubble", 1), ("interleaved", 2), ("interleaved", 3), ("1f1b", 1), ("gpipe", 1)}
    assert next(iter(rows)) == ("zero_bubble", 1)
    for o in rows.values():
        assert o["bubble"] == pytest.approx(o["bubble_formula"])
    one_f = rows["1f1b", 1]
    assert one_f["bubble"] == pytest.approx(3 / 11) and rows["interleaved", 2]["bubble"] == pytest.approx(3 / 19)
    assert rows["zero_bubble", 1]["bubble"] == pytest.approx(3 / 27)
    assert rows["zero_bubble", 1]["activation_bytes"] == one_f["activation_bytes"]  # 4 inputs + 4 gradients
    assert rows["gpipe", 1]["activation_bytes"] == 6 * one_f["activation_bytes"]  # 8 microbatches x 6 layers
    assert one_f["sends"] == 2 * 8 * 3 and rows["interleaved", 2]["sends"] == 2 * 8 * 7


def test_the_ranking_includes_pipeline_layouts():
    """`shard plan` ranks layouts with a stage axis beside the others, each with its fastest schedule
    (microbatches, virtual stages), the bubble added to its step; its command trains that schedule. On
    the reference they rank after today's best: a stage's compute waits out the bubble and recomputes its
    chunk's forward, and 1F1B gathers FSDP weights again for every microbatch."""
    from shard.config.presets import PRESETS
    from shard.measure.plan import plan, predict

    cfg, hw = PRESETS["llama-13b-24l"], find_hardware("a100-40gb", load_hardware())
    ranked = plan(cfg, 32, 8, hw, 64, 2048)
    piped = [c for c in ranked if c.pipeline]
    assert piped and all(c.sizes["stage"] > 1 for c in piped) and not ranked[0].pipeline
    assert ranked[0].mesh_spec() == "data=2,fsdp=8,model=2"
    first = next(c for c in piped if c.fits)
    command = first.command(cfg.name, 64, 2048)
    assert "--mesh stage=" in command and f"--set pipeline.schedule={first.pipeline['schedule']}" in command
    assert first.to_dict()["pipeline"]["schedule"] == first.pipeline["schedule"] and "stage" in first.comm_bytes
    # fewer microbatches, a larger bubble: the compute time grows by the busy shares' ratio
    few, many = (predict(cfg, {"stage": 4, "data": 4, "model": 2}, "full", hw, 8, 64, 2048, pipeline=("1f1b", m, 1))
                 for m in (4, 16))
    assert few.pipeline["bubble"] == pytest.approx(3 / 7) and many.pipeline["bubble"] == pytest.approx(3 / 19)
    assert few.compute_s / many.compute_s == pytest.approx((1 - 3 / 19) / (1 - 3 / 7))
