"""What a user watches: TensorBoard events, the profile summary, reports, and the divergence guard."""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from shard.cli.app import app
from shard.errors import DivergenceError
from shard.training.prepare import prepare
from shard.training.loop import train
from shard.observe.metrics import JsonlWriter, TensorBoardWriter
from shard.measure.profiling import Profiler
from shard.testing import devices_for, tiny_config
from shard.training.observer import Observer


def test_tensorboard_events_read_back_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_config("8x1")
    records = train(cfg, devices=devices_for("8x1"), observers=[TensorBoardWriter(tmp_path)])
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    np.testing.assert_allclose([e.value for e in loss], [r["loss"] for r in records], rtol=1e-6)
    assert {"train/tokens_per_s", "train/grad_norm", "train/mem_peak_bytes"} <= set(acc.Tags()["scalars"])


def test_tensorboard_forgets_the_steps_a_resume_repeats(tmp_path):
    """A crashed start logged steps 1-4; the resume from step 2's checkpoint logs 3 again. TensorBoard
    showed 1, 2, 3, 4, 3 (the curve went back, the crashed start's 3 and 4 still in it)."""
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for start, steps, loss in ((0, [1, 2, 3, 4], 9.0), (2, [3], 1.0)):
        w = TensorBoardWriter(tmp_path)
        w.on_start(SimpleNamespace(at_step=start))
        for step in steps:
            w.on_log({"step": step, "loss": loss})
        w.on_end([])
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 9.0), (2, 9.0), (3, 1.0)]


def test_a_checkpoints_blocking_time_is_not_step_time(monkeypatch):
    """A save's blocking part landed in the next interval's speed, as evaluation does not (a run saving
    at step 15 logged 1,724 tokens/s there against 27k steady). A fake clock: 1 ms per reading, and the
    save takes 100 s of it."""
    import types

    from shard.training import loop

    clock = [0.0]

    def perf_counter():
        clock[0] += 1e-3
        return clock[0]

    class SlowSaver(Observer):
        def saves_at(self, step, final):
            return step == 2

        def on_state(self, step, state, position, metrics, final):
            if step == 2:
                clock[0] += 100.0

    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=perf_counter))
    records = train(tiny_config("8x1", log_every=1), devices=devices_for("8x1"), observers=[SlowSaver()])
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[2]["step_time_s"] < 1.0 and records[2]["time_s"] > 100.0  # the clock still ran on


def test_records_carry_memory_with_its_source():
    r = train(tiny_config("8x1"), devices=devices_for("8x1"))[-1]
    assert r["mem_source"] == "compiled"  # XLA:CPU reports no live memory stats
    assert r["mem_peak_bytes"] >= r["mem_in_use_bytes"] > 0


def test_profile_is_written_and_summarised(tmp_path):
    cfg = tiny_config("8x1", steps=4)
    profiler = Profiler(2, 3, tmp_path)
    train(cfg, devices=devices_for("8x1"), observers=[profiler])
    s = json.loads((tmp_path / "profile_summary.json").read_text())
    assert s == profiler.summary and s["steps"] == 2
    assert s["compute_frac"] > 0 and s["collectives_frac"].get("all-reduce", 0) > 0  # data parallel grads
    assert abs(s["compute_frac"] + s["exposed_comm_frac"] + s["idle_frac"] - 1) < 1e-6
    assert list(tmp_path.rglob("*.xplane.pb"))  # the trace TensorBoard's profile plugin reads
    split = s["compute_split"]  # by the compiled step's op names (shares of time: no bound on each)
    assert split["forward"] > 0 and split["backward"] > 0 and split["optimizer and outside the gradient"] > 0, split
    assert abs(sum(split.values()) - 1) < 1e-6, split


def test_ops_take_their_phase_from_their_op_name_or_the_ops_they_fuse():
    from shard.measure.profiling import OUTSIDE, op_phases

    hlo = """HloModule jit_step
%fused_computation.1 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %m = f32[4]{0} multiply(%p, %p), metadata={op_name="jit(step)/transpose(jvp())/while/body/checkpoint/rematted_computation/mul"}
  ROOT %a = f32[4]{0} add(%m, %p), metadata={op_name="jit(step)/transpose(jvp())/while/body/add"}
}
ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %dot.2 = f32[4]{0} multiply(%x, %x), metadata={op_name="jit(step)/jvp()/while/body/btd,df->btf/dot_general"}
  %fusion.1 = f32[4]{0} fusion(%dot.2), kind=kLoop, calls=%fused_computation.1
  %transpose.3 = f32[4]{0} negate(%fusion.1), metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  ROOT %sqrt.4 = f32[4]{0} sqrt(%transpose.3), metadata={op_name="jit(step)/sqrt"}
}
"""
    phases = op_phases(hlo)
    assert {k: phases[k] for k in ("dot.2", "fusion.1", "transpose.3", "sqrt.4")} == {
        "dot.2": "forward", "fusion.1": "remat recompute", "transpose.3": "backward", "sqrt.4": OUTSIDE}


def test_a_run_that_stops_inside_the_profile_window_is_summarised(tmp_path):
    profiler = Profiler(2, 10, tmp_path)  # --steps 3 ends the run inside the window
    train(tiny_config("8x1", steps=3), devices=devices_for("8x1"), observers=[profiler])
    assert profiler.summary["steps"] == 2
    assert json.loads((tmp_path / "profile_summary.json").read_text()) == profiler.summary


def test_a_run_resumed_past_the_profile_windows_start_traces_nothing(tmp_path):
    """It traced from the resume to the end and summarised that as the window's 3 steps."""
    from types import SimpleNamespace

    profiler = Profiler(1, 3, tmp_path)
    profiler.on_start(SimpleNamespace(start_step=10))
    for step in range(11, 15):
        profiler.on_step(step)
    profiler.on_end([])
    assert profiler.summary is None and not list(tmp_path.iterdir())


class _Recorder(Observer):
    def __init__(self, name, events, fail_at_end=False, fail_at_start=False):
        self.name, self.events, self.fail_at_end, self.fail_at_start = name, events, fail_at_end, fail_at_start

    def on_start(self, run):
        if self.fail_at_start:
            raise OSError("cannot start")
        self.events.append(f"{self.name}.start")

    def on_end(self, records):
        self.events.append(f"{self.name}.end")
        if self.fail_at_end:
            raise OSError("the final save failed")

    def on_abort(self):
        self.events.append(f"{self.name}.abort")


def test_observers_end_last_first_and_an_end_that_fails_aborts_the_rest():
    """The console (registered first) ends last, so "done" follows the final save; when that save
    fails, the console only lets go of its display (no "done" line before the error)."""
    events = []
    observers = [_Recorder("console", events), _Recorder("saver", events, fail_at_end=True),
                 _Recorder("signals", events)]
    with pytest.raises(OSError, match="final save"):
        train(tiny_config("8x1", steps=1), devices=devices_for("8x1"), observers=observers)
    assert events == ["console.start", "saver.start", "signals.start", "signals.end", "saver.end", "saver.abort",
                      "console.abort"]
    events.clear()  # an observer that can't start: those started before it let go
    observers = [_Recorder("console", events), _Recorder("profiler", events, fail_at_start=True)]
    with pytest.raises(OSError, match="cannot start"):
        train(tiny_config("8x1", steps=1), devices=devices_for("8x1"), observers=observers)
    assert events == ["console.start", "console.abort"]


def _fake_run(path, mesh, losses, **more):
    path.mkdir()
    (path / "config.toml").write_text(f'[model]\nname = "tiny"\n[mesh]\nspec = "{mesh}"\n')
    with open(path / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": i, "loss": loss, "tokens_per_s": 1000.0 * i, "time_s": float(i),
                                "mem_peak_bytes": 2048, "mem_source": "compiled"} | more) + "\n")


def test_report_makes_pngs_and_json_for_two_runs(tmp_path, monkeypatch):
    _fake_run(tmp_path / "a", "fsdp", [3.0, 2.5, 2.0])
    _fake_run(tmp_path / "b", "2x4", [3.0, 2.8, 2.7], reward=0.5)  # a GRPO run's: its reward plotted
    out = tmp_path / "report"
    r = CliRunner().invoke(app, ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert [row["layout"] for row in doc["runs"]] == ["fsdp", "2x4"]
    assert doc["runs"][0]["final_loss"] == 2.0 and doc["runs"][1]["median_tokens_per_s"] == 2500.0
    for png in doc["plots"]:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [Path(p).name for p in doc["plots"]][-1] == "reward_vs_step.png"
    # --json alone is for a script: nothing written beside it (it wrote ./report/*.png)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    r = CliRunner().invoke(app, ["report", str(tmp_path / "a"), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["plots"] == [] and list(here.iterdir()) == []
    # an earlier report is never written over: a given --out must be empty, and report/ is followed by report-2/
    again = CliRunner().invoke(app, ["report", str(tmp_path / "a"), "--out", str(out)])
    assert again.exit_code == 2 and f"--out {out} is not empty" in again.output, again.output
    for folder in ("report", "report-2"):
        r = CliRunner().invoke(app, ["report", str(tmp_path / "a")])
        assert r.exit_code == 0 and f"plots: {folder}/loss_vs_step.png" in r.output, r.output
    assert sorted(p.name for p in here.iterdir()) == ["report", "report-2"]


def test_report_marks_where_a_run_resumed_and_on_which_layout(tmp_path):
    run = tmp_path / "a"
    _fake_run(run, "fsdp", [])
    rec = lambda step, t, start, mesh: json.dumps({"step": step, "loss": 3.0 - step / 10, "tokens_per_s": 100.0,  # noqa: E731
                                                   "time_s": t, "start_step": start, "mesh": mesh}) + "\n"
    (run / "metrics.jsonl").write_text(rec(1, 1.0, 0, "data=8") + rec(2, 2.0, 0, "data=8") + rec(3, 1.0, 2, "data=8")
                                       + rec(4, 2.0, 2, "data=8") + rec(5, 1.0, 4, "fsdp=8") + rec(6, 2.0, 4, "fsdp=8"))
    r = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    row = json.loads(r.output)["runs"][0]
    # the steps it resumed from (its checkpoints), not the first ones each start logged (3 and 5)
    assert row["model"] == "tiny" and row["resumes"] == [{"step": 2, "mesh": "data=8", "layout_changed": False},
                                                         {"step": 4, "mesh": "fsdp=8", "layout_changed": True}]
    assert row["legend"] == "tiny data=8 → fsdp=8 (a)"  # every layout its steps ran on, not the config's last
    r = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "out2")])
    cells = _table_row(r.output, str(run))
    assert cells["model"] == "tiny" and cells["resumed at"] == "2, 4 (on fsdp=8)", r.output


def test_report_draws_the_eval_loss_beside_the_loss(tmp_path, monkeypatch):
    import matplotlib.axes

    from shard.observe.report import load_run, plot

    run = tmp_path / "a"
    _fake_run(run, "fsdp", [3.0, 2.5, 2.0])
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = json.dumps(json.loads(lines[1]) | {"eval_loss": 2.7})
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    drawn, draw = [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **k: drawn.append((a, k)) or draw(ax, *a, **k))
    plot([load_run(str(run))], tmp_path / "out")
    evals = [a for a, k in drawn if k.get("label") == "tiny fsdp (a) eval"]
    assert evals == [([2], [2.7]), ([2.0], [2.7])]  # on loss by step and loss by time


def _table_row(output: str, run: str) -> dict:
    """The report table's row of `run`, by column heading."""
    split = lambda line: [c.strip() for c in line.strip().strip("│┃").split("│" if "│" in line else "┃")]  # noqa: E731
    header = next(split(line) for line in output.splitlines() if "┃ run" in line)
    row = next(split(line) for line in output.splitlines() if line.startswith("│ " + run))
    return dict(zip(header, row))


def test_a_resumed_run_is_read_as_it_trained():
    """Steps 1-4 on one mesh, a resume from step 2's checkpoint on another (its clock restarts at 0, and
    steps 3-4 come again), then a resume that repeats nothing: the last record of each step counts,
    time runs on, and speed and memory are the latest start's."""
    from shard.observe.report import as_trained, summary_row

    rec = lambda step, t, tps, mem: {"step": step, "loss": 4.0 - step / 10, "time_s": t, "tokens_per_s": tps,  # noqa: E731
                                     "mem_peak_bytes": mem, "mfu": tps / 1000}
    records = [rec(1, 1.0, 100, 9), rec(2, 2.0, 100, 9), rec(3, 3.0, 100, 9), rec(4, 4.0, 100, 9),
               rec(3, 0.5, 200, 5), rec(4, 1.0, 200, 5), rec(5, 0.4, 150, 6), rec(6, 0.8, 300, 6)]
    trained, latest = as_trained(records)
    assert [(r["step"], r["time_s"]) for r in trained] == [(1, 1.0), (2, 2.0), (3, 4.5), (4, 5.0), (5, 5.4),
                                                            (6, 5.8)]
    assert latest == 5
    row = summary_row({"dir": "r", "model": "tiny", "layout": "fsdp", "records": trained, "latest_start": latest,
                       "skipped_lines": 0})
    assert row["median_tokens_per_s"] == 300 and row["peak_memory_bytes"] == 6 and row["steps"] == 6
    assert row["mfu"] == 0.3  # from the same steps as the speed: the warm-up interval left out of both
    # a start whose clock and steps both run on past the last record: known by its start_step
    early = [rec(1, 0.5, 100, 9) | {"start_step": 0}, rec(12, 5.0, 200, 5) | {"start_step": 11},
             rec(13, 6.0, 200, 5) | {"start_step": 11}]
    trained, latest = as_trained(early)
    assert latest == 12 and [r["time_s"] for r in trained] == [0.5, 5.5, 6.5]
    # a resume from step 2 read while it trains (at step 3): the crashed start's step 4 is not its own
    live = records[:4] + [rec(3, 0.5, 200, 5)]
    trained, latest = as_trained(live)
    assert [(r["step"], r["time_s"]) for r in trained] == [(1, 1.0), (2, 2.0), (3, 4.5)] and latest == 3
    # a start that diverged at step 4 after a checkpoint at 2, resumed from 2 and logging first at step 6:
    # the diverged record below the resume's first is not kept either (its start_step says where it resumed)
    diverged = [rec(2, 2.0, 100, 9) | {"start_step": 0}, rec(4, 4.0, 100, 9) | {"start_step": 0},
                rec(6, 1.0, 200, 5) | {"start_step": 2}]
    assert [r["step"] for r in as_trained(diverged)[0]] == [2, 6]


def test_a_torn_metrics_line_is_skipped_and_the_next_record_starts_a_line(tmp_path):
    from shard.observe.metrics import JsonlWriter, read_records

    run = tmp_path / "a"
    _fake_run(run, "fsdp", [3.0, 2.5])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # killed mid-write
        f.flush()
    writer = JsonlWriter(run / "metrics.jsonl")  # the resumed run appends
    writer.on_start(None)
    writer.on_log({"step": 3, "loss": 2.0, "tokens_per_s": 3000.0, "time_s": 3.0})
    writer.on_end([])
    records, skipped = read_records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and skipped == 1
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4}) + "\n")  # a record without a loss
    r = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    row = json.loads(r.output[r.output.index("{"):])["runs"][0]
    assert row["final_loss"] == 2.0 and row["skipped_lines"] == 2
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    r = CliRunner().invoke(app, ["report", str(run), "--out", str(not_a_folder)])
    assert r.exit_code == 2 and "is a file" in r.output


@pytest.mark.parametrize("config, problem", [
    ("[model\n", "config.toml is not valid TOML"), ("model = 3\n", "config.toml's [model] or [mesh] is not a table"),
    (None, "no config.toml")])
def test_a_run_whose_config_cant_be_read_is_reported_with_a_note(tmp_path, config, problem):
    _fake_run(tmp_path / "a", "fsdp", [3.0, 2.5])
    if config is None:
        (tmp_path / "a" / "config.toml").unlink()
    else:
        (tmp_path / "a" / "config.toml").write_text(config)
    r = CliRunner().invoke(app, ["report", str(tmp_path / "a"), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert f"{problem}" in r.output and "so its model and layout are shown as ?" in r.output, r.output


def test_report_on_a_directory_that_is_not_a_run(tmp_path):
    r = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "not a run directory" in r.output


def _plant_nan(run, at_step):
    """Make one step's loss NaN through its data: a NaN in the loss mask."""
    original, count = run.stream.next, [0]

    def next_batch():
        batch = original()
        count[0] += 1
        if count[0] == at_step:
            batch["mask"] = jax.device_put(jnp.full(batch["mask"].shape, jnp.nan), batch["mask"].sharding)
        return batch

    run.stream.next = next_batch


def test_evaluation_runs_on_its_own_steps_and_is_logged_there(tmp_path):
    """`eval.every` apart from `log_every`: it only ran where the two met (here, the last step alone)."""
    cfg = tiny_config("8x1", steps=6, log_every=4, eval__every=3)
    records = train(cfg, devices=devices_for("8x1"))
    assert [r["step"] for r in records] == [3, 4, 6]
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]


def test_nan_stops_the_run_naming_the_step_and_its_record_is_kept(tmp_path):
    cfg = tiny_config("8x1", steps=6, log_every=3)
    run = prepare(cfg, devices_for("8x1"))
    _plant_nan(run, 2)
    with pytest.raises(DivergenceError, match="at step 2"):
        train(cfg, run=run, observers=[JsonlWriter(tmp_path / "metrics.jsonl")])
    assert run.state is None  # nothing downstream can save the diverged state
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 2 and record["loss"] is None and "at step 2" in record["diverged"]


def test_skip_mode_drops_the_bad_update_and_carries_on():
    cfg = tiny_config("8x1", steps=4, log_every=1, guard__action="skip")
    run = prepare(cfg, devices_for("8x1"))
    _plant_nan(run, 2)
    records = train(cfg, run=run)
    assert records[-1]["skipped_steps"] == 1
    # the logged lr is the one applied: the dropped update holds the schedule back a step
    lrs = [r["lr"] for r in records]
    assert lrs[2] == lrs[1] < lrs[3], lrs
    assert np.isfinite(records[-1]["loss"])
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(run.state["params"]))


def test_a_run_whose_every_update_was_skipped_says_so(tmp_path):
    r = CliRunner().invoke(app, ["train", "--model", "tiny", "--mesh", "8x1", "--steps", "2", "--batch", "8",
                                 "--seq", "32", "--run-dir", str(tmp_path / "r"), "--compile-cache", "none",
                                 "--set", "guard.action=skip", "--set", "guard.max_grad_norm=1e-9"])
    assert r.exit_code == 0, r.output
    assert "dropped the update of 2 of the 2 steps run (every one of them" in r.output


def test_bad_profile_window():
    r = CliRunner().invoke(app, ["train", "--model", "tiny", "--mesh", "8x1", "--profile-steps", "5:2"])
    assert r.exit_code == 2 and "A:B with 1 <= A <= B <= 100" in r.output


def test_mfu_flops_match_a_hand_count():
    from shard.config.flops import mfu_flops_per_token
    from shard.config.presets import PRESETS

    # tiny: D=64, L=2, N=K=8 heads of H=8, F=128, V=256, tied. Matmul parameters per layer: attention
    # 64*8*(8+8+8+8) = 16384, MLP 3*64*128 = 24576; two layers 81920, plus the tied table 256*64 = 16384.
    n = 2 * (16384 + 24576) + 16384
    # causal attention at half: 6 * L * T * N * H per token, T = 32
    assert mfu_flops_per_token(PRESETS["tiny"], 32) == 6 * n + 6 * 2 * 32 * 8 * 8 == 614400


def test_records_carry_mfu_and_hfu_against_the_users_peak():
    from shard.config.flops import hardware_flops_per_token, mfu_flops_per_token

    cfg = tiny_config("8x1", observe__peak_tflops=0.5)
    r = train(cfg, devices=devices_for("8x1"))[-1]
    expected = r["tokens_per_s"] * mfu_flops_per_token(cfg.model, 32) / (8 * 0.5e12)
    assert r["mfu"] == pytest.approx(expected, rel=1e-9)
    # every position is a token here (no packing): the shares differ by the FLOPs counted per token
    assert r["hfu"] == pytest.approx(expected * hardware_flops_per_token(cfg.model, 32, "cpu")
                                     / mfu_flops_per_token(cfg.model, 32), rel=1e-9)
    assert "mfu" not in train(tiny_config("8x1"), devices=devices_for("8x1"))[-1]  # CPU: omitted by default


def test_a_flop_share_above_one_is_raised_naming_both_figures(monkeypatch, tmp_path):
    """benchmarks/peak.py's cached peak is the CPU's; planted far too small, the share passes 100%."""
    import json

    from shard.hardware import FLOP_SHARE_ERROR, flop_shares, peak_cache_path

    monkeypatch.setenv("SHARD_PEAK_FILE", str(tmp_path / "peak.json"))
    peak_cache_path().write_text(json.dumps({"peak_flops": {"float32": 1e3, "bfloat16": 1e3}}))
    with pytest.raises(AssertionError, match=r"model FLOP share [\d,.]+% is above 100%: [\d,.]+ GFLOP/s done "
                                             r"against a peak of 0\.0 GFLOP/s"):
        flop_shares(2e3, 2e3, 1e3)
    # in a run it is said once, in the record where it was seen, and the shares stop: the run goes on
    records = train(tiny_config("8x1"), devices=devices_for("8x1"))
    said = [r for r in records if FLOP_SHARE_ERROR in r]
    assert len(said) == 1 and re.search(r"model FLOP share [\d,.]+% is above 100%: [\d,.]+ GFLOP/s done against "
                                        r"a peak of 0\.0 GFLOP/s", said[0][FLOP_SHARE_ERROR]), said
    assert not any("mfu" in r for r in records) and [r["step"] for r in records] == [1, 2, 3]


def test_device_kinds_find_their_hardware():
    from shard.hardware import hardware_for_device

    assert hardware_for_device("NVIDIA H100 80GB HBM3", "gpu").name == "h100"
    assert hardware_for_device("NVIDIA H200", "gpu").name == "h200"
    # the PCIe and NVL forms have lower peaks: taken for the SXM part, their MFU read low
    assert hardware_for_device("NVIDIA H100 PCIe", "gpu").bf16_tflops == 756.0
    assert hardware_for_device("NVIDIA H100 NVL", "gpu").name == "h100-nvl"
    assert hardware_for_device("NVIDIA H200 NVL", "gpu").name == "h200-nvl"
    assert hardware_for_device("NVIDIA A100-SXM4-40GB", "gpu").name == "a100-40g"
    assert hardware_for_device("NVIDIA A100-SXM4-80GB", "gpu").name == "a100-80g"
    assert hardware_for_device("cpu", "cpu").name == "cpu"
    assert hardware_for_device("Some Future Chip", "gpu") is None


def test_startup_warns_when_data_parallel_traffic_outweighs_compute():
    from shard import config
    from shard.hardware import find_hardware, load_hardware
    from shard.measure.plan import startup_warnings

    h100 = find_hardware("h100", load_hardware())
    # llama-1b, FSDP over 8 GPUs with 1 sequence of 256 tokens per GPU: gathers dwarf the compute
    cfg = config.resolve(config.parse_sets(["model.name=llama-1b", "data.batch=8", "data.seq_len=256"]))
    warnings = startup_warnings(cfg, {"fsdp": 8}, h100, hosts=1)
    assert any(w.startswith("communication-bound on fsdp") and "break-even" in w for w in warnings), warnings
    big = config.resolve(config.parse_sets(["model.name=llama-1b", "data.batch=64", "data.seq_len=4096"]))
    assert not startup_warnings(big, {"fsdp": 8}, h100, hosts=1)


def test_nan_between_saves_leaves_the_last_good_checkpoint_newest(tmp_path):
    from shard.run.checkpoint import Checkpoints, SaveCheckpoints
    from shard.config.train import CheckpointConfig

    cfg = tiny_config("8x1", steps=8, log_every=4)
    run = prepare(cfg, devices_for("8x1"))
    _plant_nan(run, 5)
    ckpts = Checkpoints(tmp_path / "checkpoints", CheckpointConfig(every=2, keep=10))
    saver = SaveCheckpoints(ckpts, seed=cfg.seed, config_toml="")
    # Step 6 is a save step: the guard checks steps 5 and 6 before it, finds the NaN, and stops.
    with pytest.raises(DivergenceError, match="at step 5"):
        train(cfg, run=run, observers=[saver])
    ckpts.close()
    again = Checkpoints(tmp_path / "checkpoints", CheckpointConfig(every=2, keep=10))
    assert again.steps() == [2, 4]
    restored = again.restore_latest(prepare(cfg, devices_for("8x1")).spec)
    assert restored.step == 4
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.state["params"]))
    again.close()


def test_a_skipped_steps_nan_is_null_in_metrics_and_the_report_still_reads_it(tmp_path):
    """metrics.jsonl is strict JSON (a NaN token breaks strict parsers), and report takes the null."""
    from shard.observe.metrics import JsonlWriter

    run = tmp_path / "a"
    _fake_run(run, "dp", [3.0])
    writer = JsonlWriter(run / "metrics.jsonl")
    writer.on_start(None)
    writer.on_log({"step": 2, "loss": float("nan"), "grad_norm": float("inf"), "tokens_per_s": 3000.0, "time_s": 2.0})
    writer.on_end([])
    last = (run / "metrics.jsonl").read_text().splitlines()[-1]
    assert json.loads(last, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))["loss"] is None
    r = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    cells = _table_row(r.output, str(run))
    assert cells["final loss"] == "-" and cells["steps"] == "2", r.output  # the null loss, not a number


def test_writers_hold_nothing_open_until_the_run_starts(tmp_path):
    """A writer built for a run that never started (an earlier observer's on_start raised) left a file
    open, and tensorboardX's writer failed to close at interpreter exit on Python 3.12."""
    from shard.observe.metrics import JsonlWriter

    writers = [JsonlWriter(tmp_path / "metrics.jsonl"), TensorBoardWriter(tmp_path / "tb")]
    for w in writers:
        w.on_abort()
    assert list(tmp_path.iterdir()) == []


def test_a_record_with_a_field_of_the_wrong_type_is_skipped_like_a_torn_line(tmp_path):
    """report computed with whatever a record held: a string time or loss was a traceback."""
    from shard.observe.metrics import read_records

    path = tmp_path / "metrics.jsonl"
    lines = ['{"step": 1, "loss": 1.0, "time_s": "x"}', '{"step": [1], "loss": 1.0}', '{"step": 2, "loss": "abc"}',
             '{"step": 3, "loss": true}', '{"step": 4, "loss": null, "mem_source": "device", "time_s": 2}',
             '{"step": null, "loss": 1.0}', '{"step": 5, "time_s": null}', '{"step": 6.5}']
    path.write_text("\n".join(lines) + "\n")
    records, skipped = read_records(path)
    assert [r["step"] for r in records] == [4] and skipped == 7


def test_report_does_not_write_among_a_runs_checkpoints(tmp_path):
    """Its PNGs in checkpoints/5 made the next --resume set that checkpoint aside as corrupt."""
    _fake_run(tmp_path / "a", "fsdp", [3.0, 2.5])
    (tmp_path / "a" / "checkpoints" / "5" / "state").mkdir(parents=True)
    r = CliRunner().invoke(app, ["report", str(tmp_path / "a"), "--out", str(tmp_path / "a" / "checkpoints" / "5")])
    assert r.exit_code == 2 and "is in the checkpoints folder of the run" in r.output, r.output
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints" / "5").iterdir()) == ["state"]


def test_the_event_writer_imports_neither_torch_nor_boto3():
    """tensorboardX probes for torch and imports boto3 for S3 log dirs: 0.2 s of a launch for nothing."""
    import subprocess
    import sys

    code = ("import sys; from shard.observe.metrics import _summary_writer_class; _summary_writer_class(); "
            "print(sorted(m for m in ('torch', 'boto3') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_full_disk_under_the_writers_names_the_file_and_leaves_no_exit_tracebacks(tmp_path, monkeypatch):
    """metrics.jsonl's write error had no file name ("OSError: [Errno 28] ..."), and tensorboardX's own
    close at exit failed again after the error and printed its traceback."""
    import atexit
    import errno
    from types import SimpleNamespace

    from shard.cli.app import user_error

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    jsonl = JsonlWriter(tmp_path / "metrics.jsonl")
    jsonl._f = FullDisk()
    with pytest.raises(OSError) as raised:
        jsonl.on_log({"step": 1, "loss": 1.0})
    assert str(user_error(raised.value)) == f"{tmp_path / 'metrics.jsonl'}: No space left on device"

    tb = TensorBoardWriter(tmp_path / "tb")
    tb.on_start(SimpleNamespace(at_step=0))
    (theirs,) = tb._at_exit  # tensorboardX's close at exit, taken over
    real_close, tb._w.close = tb._w.close, FullDisk().close
    unregistered = []
    monkeypatch.setattr(atexit, "unregister", unregistered.append)
    tb.on_abort()  # the error under way is the one reported: closing quietly fails
    assert unregistered == [theirs] and theirs.__qualname__.startswith("FileWriter.")
    real_close()


def test_a_misspelt_hook_fails_when_its_class_is_made_and_train_takes_observers_only():
    with pytest.raises(TypeError, match="on_stpe is not an Observer hook"):
        class Misspelt(Observer):
            def on_stpe(self, step, outputs=None):
                pass

    class NotAnObserver:
        def on_step(self, step, outputs=None):
            pass

    with pytest.raises(TypeError, match="NotAnObserver is not a shard.training.observer.Observer"):
        train(tiny_config("8x1", steps=1), devices=devices_for("8x1"), observers=[NotAnObserver()])


def _step_record(step: int, step_time_s: float, time_s: float, start_step: int, mesh: str) -> str:
    """A step record as the loop writes it (the keys of a real one, shard.training.loop._record)."""
    return json.dumps({"step": step, "loss": 5.0 - step / 100, "grad_norm": 1.5, "lr": 1e-3,
                       "tokens_per_s": 256 / step_time_s, "step_time_s": step_time_s, "tokens_seen": 256 * step,
                       "time_s": time_s, "start_step": start_step, "mesh": mesh, "mem_in_use_bytes": 1183900,
                       "mem_peak_bytes": 2802556, "mem_source": "compiled"}) + "\n"


def _launched_run(path: Path) -> None:
    """A run shard launch held for 85 s: logged every 10 steps, a process lost after step 40 (the job
    resumes from the local snapshot of step 35 on 3 processes), then grown back to 4 at step 60's checkpoint."""
    _fake_run(path, "data=4,model=2", [])
    t0, first, second = 1000.0, "data=4,model=2", "data=3,model=2"
    lines = [json.dumps({"event": "launch_start", "time": t0, "processes": 4, "mesh": first, "min_processes": 2,
                         "max_processes": 4}) + "\n"]
    lines += [_step_record(s, 0.5, s * 0.5, 0, first) for s in (10, 20, 30, 40)]
    lines.append(json.dumps({"event": "resize", "time": t0 + 30, "step": 35, "reason": "lost", "lost_processes": [2],
                             "hosts": ["h3"], "processes": 3, "mesh": second, "source": "local snapshot",
                             "steps_redone": 7}) + "\n")
    lines += [_step_record(40, 0.6, 3.0, 35, second), _step_record(50, 0.6, 9.0, 35, second),
              _step_record(60, 0.6, 15.0, 35, second)]
    lines.append(json.dumps({"event": "resize", "time": t0 + 60, "step": 60, "reason": "grow", "lost_processes": [],
                             "hosts": ["h3"], "processes": 4, "mesh": first, "source": "checkpoint",
                             "steps_redone": 0}) + "\n")
    lines += [_step_record(70, 0.5, 5.0, 60, first), _step_record(80, 0.5, 10.0, 60, first)]
    lines.append(json.dumps({"event": "launch_end", "time": t0 + 85, "held_s": 85.0, "ended": "finished",
                             "restarts": 2, "recoveries": [{"step": 35, "recovery_s": 11.2},
                                                           {"step": 60, "recovery_s": 4.0}]}) + "\n")
    (path / "metrics.jsonl").write_text("".join(lines))


def test_report_marks_resizes_and_counts_goodput_of_a_launched_run(tmp_path, monkeypatch):
    """Time training: steps 1-35 of the first job at 0.5 s (its record of step 40 stands for 31-40, of which
    36-40 were redone), 36-60 of the second at 0.6 s, 61-80 of the third at 0.5 s: 17.5 + 15 + 10 = 42.5 s
    of the 85 held, goodput 50%. A run without events shows - in the new columns."""
    import matplotlib.figure

    _launched_run(tmp_path / "a")
    _fake_run(tmp_path / "b", "fsdp", [3.0, 2.5])
    drawn, savefig = {}, matplotlib.figure.Figure.savefig

    def keep(fig, name, *args, **kwargs):  # the figures as drawn, to read their marks back
        drawn[Path(name).name] = fig
        return savefig(fig, name, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    launched, plain = json.loads(r.output)["runs"]
    assert [(x["step"], x["reason"], x["processes"], x["mesh"]) for x in launched["resizes"]] == [
        (35, "lost", 3, "data=3,model=2"), (60, "grow", 4, "data=4,model=2")]
    assert launched["steps_redone"] == 7 and launched["time_held_s"] == 85.0
    assert launched["time_training_s"] == pytest.approx(42.5) and launched["goodput"] == pytest.approx(0.5)
    assert launched["skipped_lines"] == 0 and launched["steps"] == 80  # events are neither records nor torn lines
    assert [x["step"] for x in launched["resumes"]] == [35, 60]  # the resume marks stay, at the steps resumed from
    assert all(plain[k] is None for k in ("resizes", "steps_redone", "goodput", "time_held_s", "time_training_s"))
    for png in json.loads(r.output)["plots"]:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def vertical(fig, style):  # x of the vertical lines drawn in this line style
        return [line.get_xdata()[0] for line in fig.axes[0].get_lines() if line.get_linestyle() == style
                and len(line.get_xdata()) == 2 and line.get_xdata()[0] == line.get_xdata()[1]]

    labels = ["lost → 3 processes (data=3,model=2)", "grow → 4 processes (data=4,model=2)"]
    for name in ("loss_vs_step.png", "throughput_vs_step.png"):
        assert vertical(drawn[name], "-") == [35, 60] and vertical(drawn[name], "--") == [35, 60], name
        assert [t.get_text() for t in drawn[name].axes[0].texts] == ["data=3,model=2", "data=4,model=2", *labels]
        assert "solid: resized" in drawn[name].axes[0].get_title()
    # on the time chart, where the kept steps reached the step resumed from (time runs on across starts)
    assert vertical(drawn["loss_vs_time.png"], "-") == pytest.approx([19.0, 35.0])
    r = CliRunner().invoke(app, ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "out2")])
    assert r.exit_code == 0 and "skipped" not in r.output, r.output
    cells, none = _table_row(r.output, str(tmp_path / "a")), _table_row(r.output, str(tmp_path / "b"))
    assert (cells["resizes"], cells["steps redone"], cells["goodput"]) == ("2", "7", "50.0%"), r.output
    assert (none["resizes"], none["steps redone"], none["goodput"]) == ("-", "-", "-"), r.output
    r = CliRunner().invoke(app, ["report", str(tmp_path / "b"), "--out", str(tmp_path / "out3")])
    assert r.exit_code == 0 and "goodput" not in r.output, r.output  # runs without events: the table as it was


def test_goodput_counts_only_the_steps_a_launch_held(tmp_path):
    """Steps a plain `shard train` logged before the launch are not the launch's time; a launch that has
    not ended has no goodput yet, though its resizes count."""
    from shard.observe.metrics import read_lines
    from shard.observe.report import launch_summary

    path, mesh = tmp_path / "metrics.jsonl", "data=4"
    before = [_step_record(s, 1.0, float(s), 0, mesh) for s in (10, 20)]
    start = json.dumps({"event": "launch_start", "time": 50.0, "processes": 4, "mesh": mesh}) + "\n"
    resize = json.dumps({"event": "resize", "time": 60.0, "step": 30, "reason": "lost", "processes": 2,
                         "mesh": "data=2", "steps_redone": 3}) + "\n"
    launched = [_step_record(30, 0.25, 2.5, 20, mesh), _step_record(40, 0.5, 5.0, 30, "data=2")]
    end = json.dumps({"event": "launch_end", "time": 70.0, "ended": "stopped"}) + "\n"  # no held_s: the times'
    path.write_text("".join(before + [start] + launched[:1] + [resize] + launched[1:] + [end]))
    summary = launch_summary(read_lines(path)[0])
    assert summary["time_held_s"] == 20.0 and summary["time_training_s"] == 7.5 and summary["goodput"] == 0.375
    path.write_text("".join(before + [start] + launched[:1] + [resize] + launched[1:]))
    summary = launch_summary(read_lines(path)[0])
    assert summary["goodput"] is None and summary["steps_redone"] == 3 and len(summary["resizes"]) == 1
    path.write_text("".join(before))
    assert launch_summary(read_lines(path)[0]) is None
    # from an offset (the file's size taken earlier, as the supervisor reads): the lines after it alone
    assert read_lines(path, len(before[0].encode()))[0] == [json.loads(before[1])]


def test_read_jsonl_leaves_events_out_without_counting_them_skipped(tmp_path):
    from shard.observe.metrics import append_event, read_events, read_jsonl, read_records

    _launched_run(tmp_path / "a")
    path = tmp_path / "a" / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 81, "lo')  # a job killed mid-write, then the supervisor's event
    append_event(path, {"event": "launch_start", "time": 2000.0, "processes": 2, "mesh": "data=2,model=2"})
    with open(path, "a") as f:
        f.write(json.dumps({"event": "resize", "time": "soon", "step": 81}) + "\n")  # not an event report can read
    records, skipped = read_records(path)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 40, 50, 60, 70, 80] and skipped == 2
    assert [r["step"] for r in read_jsonl(path)] == [r["step"] for r in records]
    assert [e["event"] for e in read_events(path)] == ["launch_start", "resize", "resize", "launch_end", "launch_start"]
    with pytest.raises(ValueError, match="not an event record"):
        append_event(path, {"event": "resize", "time": 1.0, "step": 3.5})


def test_the_console_shows_mfu_memory_a_moes_balance_and_the_time(monkeypatch, tmp_path):
    """A file's line per logged step and the terminal's bar showed loss and tokens/s alone, though the
    record held MFU, memory and the time; a MoE's aux loss and expert load reached only the file."""
    import io
    import types

    from rich.console import Console

    from shard.observe import progress

    r = {"step": 10, "loss": 6.689, "tokens_per_s": 830.0, "step_time_s": 6.0, "time_s": 65.2, "mfu": 0.1234,
         "mem_peak_bytes": 1.3e9, "mem_source": "device", "aux_loss": 1.0213, "expert_load_min": 0.81,
         "expert_load_max": 1.243, "tokens_dropped": 1234.0}
    assert progress.step_line(r, 200) == ("step 10/200 · loss 6.6890 · 830 tokens/s · MFU 12.3% · mem 1.2G · aux 1.021 "
                                          "· load 0.81-1.24 · dropped 1,234 · 0:01:05 elapsed, ETA 0:19:00")
    estimate = {k: r[k] for k in ("step", "loss", "tokens_per_s")} | {"mem_peak_bytes": 1.5e8, "mem_source": "compiled"}
    assert progress.step_line(estimate, 200) == "step 10/200 · loss 6.6890 · 830 tokens/s · mem ~143M"
    terminal = Console(file=io.StringIO(), force_terminal=True, width=200)
    monkeypatch.setattr(progress, "console", terminal)
    bar = progress.ConsoleProgress(types.SimpleNamespace(steps=200), tmp_path)
    bar.progress.start()
    bar.on_log(r)
    bar.on_abort()
    shown = terminal.file.getvalue()
    assert "MFU 12.3% · mem 1.2G · aux 1.021 · load 0.81-1.24 · dropped 1,234" in shown and "ETA" in shown, shown
