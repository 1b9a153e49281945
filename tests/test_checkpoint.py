"""Checkpoints in one process: exact resume after SIGTERM, restore onto other meshes, retention, and
every bad input (shape mismatch, corrupt and incomplete checkpoints, empty dirs, foreign run dirs)."""

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from typer.testing import CliRunner

from shard import config as config_mod
from shard.config.train import CheckpointConfig
from shard.paths import CHECKPOINTS_DIR
from shard.run.checkpoint import TMP_MARK, Checkpoints, SaveCheckpoints, step_dirs
from shard.cli.app import app
from shard.errors import ShardError
from shard.sharding.layout import make_layout
from shard.training.prepare import prepare
from shard.training.loop import train
from shard.sharding.mesh import parse_mesh
from shard.observe.metrics import read_jsonl
from shard.paths import RunDirLock
from shard.training.preemption import StopOnSignal, remember_interrupts
from shard.training.state import state_spec
from shard.testing import devices_for, free_ports, subprocess_env, tiny_config
from shard.testing import finish as finish_all
from shard.training.observer import Observer

STEPS = 12
EVERY = 2


def checkpointed_run(run_dir, cfg, observers=(), restore=None, every=EVERY):
    """Train `cfg` on its mesh in this process, saving into run_dir/checkpoints; (losses, run, ckpts)."""
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir),
                              checkpoint=dataclasses.replace(cfg.checkpoint, every=every, keep=10))
    run_dir.mkdir(parents=True, exist_ok=True)
    toml = config_mod.to_toml(cfg)
    (run_dir / "config.toml").write_text(toml)
    notices = []
    ckpts = Checkpoints(run_dir / CHECKPOINTS_DIR, cfg.checkpoint, notice=notices.append)
    run = prepare(cfg, devices_for(cfg.mesh.spec), restore=(restore or (lambda c: None))(ckpts))
    saver = SaveCheckpoints(ckpts, seed=cfg.seed, config_toml=toml)
    records = train(cfg, run=run, observers=[saver, *observers])
    ckpts.notices = notices
    return [r["loss"] for r in records], run, ckpts


_OPEN: list = []


def request_close(ckpts: Checkpoints) -> Checkpoints:
    """Close orbax managers at the end of the test, not whenever the garbage collector gets to them."""
    _OPEN.append(ckpts)
    return ckpts


@pytest.fixture(autouse=True)
def _close_checkpoints():
    yield
    while _OPEN:
        _OPEN.pop().close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 12-step run on 2x4 that saves every 2 steps; its final state on the host."""
    cfg = tiny_config("2x4", steps=STEPS)
    losses, run, ckpts = checkpointed_run(tmp_path_factory.mktemp("ref") / "run", cfg)
    yield cfg, losses, jax.device_get(run.state), ckpts
    ckpts.close()


class SignalAt(Observer):
    """Sends a signal to this process while step `at` runs, as a scheduler's preemption would."""

    def __init__(self, at: int, sig=signal.SIGTERM):
        self.at, self.sig = at, sig

    def on_step(self, step, outputs=None):
        if step == self.at - 1:  # after step at-1's observers: the loop is on to step `at`
            os.kill(os.getpid(), self.sig)


def assert_trees_equal(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_saves_every_n_steps_and_keeps_the_newest(reference):
    _, losses, _, ckpts = reference
    assert len(losses) == STEPS and len(set(np.round(losses, 6))) == STEPS
    assert ckpts.steps() == [2, 4, 6, 8, 10, 12]
    assert not ckpts.incomplete()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_the_current_step_and_resume_is_exact(reference, tmp_path, sig):
    cfg, ref_losses, _, _ = reference
    stopper = StopOnSignal()
    first, run, ckpts = checkpointed_run(tmp_path, cfg, observers=[SignalAt(3, sig), stopper], every=0)
    request_close(ckpts)
    assert run.stopped_at == 3 and stopper.received == signal.Signals(sig).name
    assert ckpts.steps() == [3]  # the step the signal arrived in, saved and committed
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored after the loop
    second, run2, ckpts2 = checkpointed_run(tmp_path, cfg, restore=lambda c: c.restore_latest, every=0)
    request_close(ckpts2)
    assert run2.start_step == 3 and run2.stream.position == STEPS * cfg.data.batch
    assert first + second == ref_losses  # bitwise: no sample skipped or repeated, same optimizer state


def test_a_signal_in_the_last_step_ends_the_run_as_done(reference, tmp_path):
    """It said "stopped early ... continue with --resume", and the resume found nothing to do."""
    cfg, ref_losses, _, _ = reference
    stopper = StopOnSignal()
    losses, run, ckpts = checkpointed_run(tmp_path, cfg, observers=[SignalAt(STEPS), stopper], every=0)
    request_close(ckpts)
    assert stopper.received == "SIGTERM" and run.stopped_at is None  # done, not stopped early
    assert ckpts.steps() == [STEPS] and losses == ref_losses


@pytest.mark.parametrize("at, stopped_at", [(3, 2), (7, None)])
def test_a_signal_during_an_evaluation_ends_it_and_saves_that_step(tmp_path, at, stopped_at):
    """A SIGTERM that came during an evaluation waited for all of it, and then one more step: with
    eval.batches=1e20 it was ignored for good, and a scheduler's grace period runs out on a long one.
    It is asked between eval batches: the evaluation is dropped and the step it followed saved. After
    the last step the run ends as it would have (a resume would find nothing to do)."""
    cfg = tiny_config("2x4", steps=6, eval__every=2, eval__batches=200)
    stopper = StopOnSignal()
    losses, run, ckpts = checkpointed_run(tmp_path, cfg, observers=[SignalAt(at), stopper], every=0)
    request_close(ckpts)  # SignalAt(at) signals after step at - 1, before its evaluation
    step = stopped_at or cfg.steps
    assert run.stopped_at == stopped_at and ckpts.steps() == [step] and stopper.received == "SIGTERM"
    assert len(losses) == step


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped one, on purpose
def test_a_ctrl_c_that_python_drops_before_the_loop_still_stops_the_run():
    """A Ctrl-C during a resume's start-up raised its KeyboardInterrupt in JAX's garbage-collection
    callback, where Python prints "Exception ignored" and drops it: the run trained on (2 of 6 tries at
    5-6 s into `shard train --resume`). Remembered, it stops the loop before its first step."""
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN under a shell's background job
    restore = remember_interrupts()
    try:
        class Collected:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(10_000):  # the handler runs in here, and its exception is dropped
                    pass

        Collected()
        with pytest.raises(KeyboardInterrupt):
            StopOnSignal().on_start(None)
        stopper = StopOnSignal()  # once: the next loop starts
        stopper.on_start(None)
        stopper.on_abort()
    finally:
        restore()
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("mesh", ["8x1", "4x2", "fsdp_tp:4x2", "1x1"])
def test_restore_onto_another_mesh_reads_each_array_into_its_new_sharding(reference, mesh):
    cfg, _, final_state, ckpts = reference
    other = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, spec=mesh))
    layout = make_layout(other, parse_mesh(mesh), devices_for(mesh))
    spec = state_spec(other.model, other.optimizer, other.steps, layout)
    restored = ckpts.restore(STEPS, spec)
    assert restored.step == STEPS and restored.position == STEPS * cfg.data.batch
    for array, sharding in zip(jax.tree.leaves(restored.state), jax.tree.leaves(spec.shardings), strict=True):
        assert array.sharding == sharding
    assert_trees_equal(restored.state, final_state)


def test_restored_run_on_another_mesh_continues_within_fp_tolerance(reference, tmp_path):
    cfg, ref_losses, _, ckpts = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ckpts.directory.parent, run_dir, ignore=shutil.ignore_patterns("[6-9]", "1[0-9]"))
    other = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, spec="8x1"))
    losses, run, ckpts2 = checkpointed_run(run_dir, other, restore=lambda c: lambda spec: c.restore(4, spec))
    request_close(ckpts2)
    assert run.start_step == 4
    np.testing.assert_allclose(losses, ref_losses[4:], rtol=1e-5)


def test_best_checkpoint_is_kept_beside_the_newest(tmp_path):
    cfg = tiny_config("8x1", steps=6, checkpoint__keep=1, checkpoint__best_metric="loss", checkpoint__every=1)
    ckpts = request_close(Checkpoints(tmp_path, cfg.checkpoint))
    for step, loss in enumerate([5.0, 3.0, 4.0, 6.0], start=1):
        ckpts.save(step, {"x": np.float32(step)}, position=step, seed=0, config_toml="", metrics={"loss": loss})
        ckpts.wait()
    assert ckpts.steps() == [2, 4]  # the lowest loss and the newest
    ckpts.close()
    reopened = request_close(Checkpoints(tmp_path, cfg.checkpoint))  # a restart: the ranking is read back
    reopened.save(5, {"x": np.float32(5)}, position=5, seed=0, config_toml="", metrics={"loss": 7.0})
    reopened.wait()
    assert reopened.steps() == [2, 5]


def test_a_resume_may_change_the_metric_and_keeps_checkpoints_written_without_one(tmp_path):
    """A save ranked by another metric (best_metric changed on a resume) ranks last: it raised KeyError
    at the first save. Checkpoints with no metrics on disk (written before shard recorded them, or with
    no best_metric) are kept, not deleted as unranked."""
    def save(ckpts, step, metrics):
        ckpts.save(step, {"x": np.float32(step)}, position=step, seed=0, config_toml="", metrics=metrics)
        ckpts.wait()

    plain = Checkpoints(tmp_path, tiny_config(checkpoint__keep=5).checkpoint)
    save(plain, 1, None)
    plain.close()
    by_loss = Checkpoints(tmp_path, tiny_config(checkpoint__keep=1, checkpoint__best_metric="loss").checkpoint)
    for step, loss in [(2, 1.0), (3, 2.0)]:
        save(by_loss, step, {"loss": loss})
    assert by_loss.steps() == [1, 2, 3]
    by_loss.close()
    by_norm = request_close(Checkpoints(tmp_path, tiny_config(checkpoint__keep=1, checkpoint__best_metric="grad_norm",
                                                              checkpoint__best_mode="max").checkpoint))
    for step, norm in [(4, 0.5), (5, 0.1)]:
        save(by_norm, step, {"grad_norm": norm})
    assert by_norm.steps() == [1, 4, 5]  # the largest norm and the newest; 2 and 3 ranked by loss went


def test_a_resume_that_changes_the_ranking_says_what_becomes_of_the_earlier_saves():
    from shard import config
    from shard.run.resume import resume_changes

    def notes(was: dict, now: dict) -> list[str]:
        base = {"model": {"name": "tiny"}, "checkpoint": was}
        return resume_changes(base, config.resolve({"model": {"name": "tiny"}, "checkpoint": now}))

    loss = {"best_metric": "loss"}
    assert notes(loss, loss) == [] and notes({}, {"best_mode": "max"}) == []
    assert notes(loss, {}) == ["the checkpoint ranking changes (checkpoint.best_metric loss -> (none)): the best "
                               "checkpoints saved so far are kept only while among the newest 3"]
    assert "recorded no grad_norm: they rank last" in notes(loss, {"best_metric": "grad_norm"})[0]
    assert "unranked checkpoints are all kept" in notes({}, loss)[0]
    assert "ranked again: the highest loss is the best" in notes(loss, loss | {"best_mode": "max"})[0]


def test_best_by_eval_loss_ranks_each_save_by_the_evaluation_at_its_step(tmp_path):
    cfg = tiny_config("8x1", checkpoint__keep=1, checkpoint__best_metric="eval_loss", checkpoint__every=2,
                      eval__every=2)
    ckpts = request_close(Checkpoints(tmp_path, cfg.checkpoint))
    saver = SaveCheckpoints(ckpts, seed=0, config_toml="")
    for step, eval_loss in [(2, 3.0), (4, 2.0), (6, 4.0), (7, None)]:  # 7: a stop between evaluations
        saver.on_log({"step": step} | ({"eval_loss": eval_loss} if eval_loss else {}))
        saver.on_state(step, {"x": np.float32(step)}, step, {"loss": np.float32(9.0)}, final=step == 7)
        ckpts.wait()
    assert ckpts.steps() == [4, 7]  # the lowest eval loss and the newest; 7, unranked, goes when it is not


def test_a_run_ranked_by_eval_loss_records_it_with_each_save(tmp_path):
    cfg = tiny_config("8x1", steps=4, checkpoint__best_metric="eval_loss", eval__every=2)
    losses, run, ckpts = checkpointed_run(tmp_path / "run", cfg)
    request_close(ckpts)
    ranked = {s: json.loads((ckpts.path(s) / "metrics" / "metrics").read_text()) for s in ckpts.steps()}
    assert list(ranked) == [2, 4] and all(set(m) == {"eval_loss"} and m["eval_loss"] > 0 for m in ranked.values())


def test_shape_mismatch_names_the_parameter_and_both_shapes(reference):
    _, _, _, ckpts = reference
    other = tiny_config("2x4", steps=STEPS, model__mlp_dim=256)
    layout = make_layout(other, parse_mesh("2x4"), devices_for("2x4"))
    spec = state_spec(other.model, other.optimizer, other.steps, layout)
    with pytest.raises(ShardError, match=r"parameter layers/w_\w+ is \(2, (64, 128|128, 64)\) in checkpoint "
                                         r"\S+/12 but \(2, (64, 256|256, 64)\) in the model"):
        ckpts.restore_latest(spec)
    assert ckpts.steps() == [2, 4, 6, 8, 10, 12]  # nothing set aside or deleted


@pytest.mark.parametrize("name", ["lion", "adam"])
def test_another_optimizers_state_is_refused_and_the_checkpoint_kept(reference, name):
    """Restoring into a spec of another optimizer (state_spec(tx=...)) failed inside orbax's read, which
    set the good checkpoint aside as corrupt and said --resume --allow-fresh would start over. Adam's
    arrays have the shapes of the run's clipped AdamW's, in another tree."""
    import optax

    cfg, _, _, ckpts = reference
    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices_for(cfg.mesh.spec))
    tx = {"lion": optax.lion(1e-4), "adam": optax.adam(1e-4)}[name]
    other = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout, tx=tx, schedule=optax.constant_schedule(1e-4))
    with pytest.raises(ShardError, match=r"the optimizer state in checkpoint \S+/12 is another optimizer's "
                                         r"\(\d+ arrays; this optimizer keeps \d+, and they differ at opt_state/"):
        ckpts.restore_latest(other)
    assert ckpts.steps() == [2, 4, 6, 8, 10, 12]


def _copy_checkpoints(reference, tmp_path):
    cfg, _, _, ckpts = reference
    shutil.copytree(ckpts.directory, tmp_path / CHECKPOINTS_DIR)
    notices = []
    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices_for(cfg.mesh.spec))
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    return request_close(Checkpoints(tmp_path / CHECKPOINTS_DIR, cfg.checkpoint, notice=notices.append)), spec, notices


# When one read of a corrupt checkpoint fails, orbax closes its event loop while tensorstore's other
# reads still finish and report to it: "Event loop is closed", raised in a callback, harmless.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_newest_falls_back_to_the_previous_and_says_so(reference, tmp_path):
    ckpts, spec, notices = _copy_checkpoints(reference, tmp_path)
    for f in (ckpts.path(12) / "state" / "d").iterdir():
        f.write_bytes(b"garbage")
    restored = ckpts.restore_latest(spec)
    assert restored.step == 10
    assert len(notices) == 1 and "is unreadable" in notices[0] and "falling back to step 10" in notices[0]
    assert (ckpts.directory / "corrupt-12").is_dir()  # set aside, not deleted
    assert ckpts.steps() == [2, 4, 6, 8, 10]


@pytest.mark.parametrize("error, cause", [
    (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 12.00GiB."), None),
    (PermissionError(13, "Permission denied", "state/d/0"), None),
    (Exception("Reading array failed. See full TensorStore details: <bound method ...>"),  # orbax's wrapper
     ValueError('OPEN: error opening "/x/state/d/0" [os_error_code=13]: Permission denied')),
])
def test_a_read_the_machine_fails_sets_nothing_aside(reference, tmp_path, monkeypatch, error, cause):
    """Out of memory (resuming onto fewer devices) or no permission would fail every checkpoint in turn:
    falling back set each good one aside and then offered a fresh start."""
    ckpts, spec, notices = _copy_checkpoints(reference, tmp_path)

    def fail(step, spec):
        raise error from cause

    monkeypatch.setattr(ckpts, "_read", fail)
    with pytest.raises(ShardError, match=r"cannot read checkpoint \S*checkpoints/12 \(.*\); it is left in place"):
        ckpts.restore_latest(spec)
    assert notices == [] and ckpts.steps() == [2, 4, 6, 8, 10, 12]
    assert not list(ckpts.directory.glob("corrupt-*"))


def test_a_path_with_brackets_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ShardError, match=r"contains \[ or \], which orbax reads as a glob pattern"):
        Checkpoints(tmp_path / "[x]" / CHECKPOINTS_DIR)
    assert not (tmp_path / "[x]").exists()
    r = invoke("train", *TINY, "--run-dir", str(tmp_path / "[x]"))  # train refuses it before the compile cache
    assert r.exit_code == 2 and "contains [ or ]" in r.output and len(r.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_negative_data_position_reads_as_unreadable(reference, tmp_path):
    ckpts, spec, notices = _copy_checkpoints(reference, tmp_path)
    meta = ckpts.path(12) / "meta" / "metadata"
    meta.write_text(json.dumps(json.loads(meta.read_text()) | {"data_position": -5}))
    assert ckpts.restore_latest(spec).step == 10
    assert "negative data_position -5" in notices[0] and (ckpts.directory / "corrupt-12").is_dir()


@pytest.mark.parametrize("change, says", [
    ({"step": "six"}, "meta's step is 'six', not an integer"),
    ({"step": 6}, "meta says step 6, but the folder is named 12 (renamed?)"),
    ({"data_position": 10**30}, "meta's data_position 1000000000000000000000000000000 is out of range"),
    ({"seed": 1.5}, "meta's seed is 1.5, not an integer"),
    ({"held_out_since": 13}, "meta's held_out_since 13 is out of range (0..12)"),
])
def test_a_meta_that_does_not_describe_its_step_is_set_aside_and_named(reference, tmp_path, change, says):
    """The folder's name was trusted: checkpoints/6 renamed 60 resumed "from step 60"; "step": "six" and a
    data_position of 10**30 (training on other data) were accepted."""
    ckpts, spec, notices = _copy_checkpoints(reference, tmp_path)
    meta = ckpts.path(12) / "meta" / "metadata"
    meta.write_text(json.dumps(json.loads(meta.read_text()) | change))
    assert ckpts.restore_latest(spec).step == 10
    assert says in notices[0] and (ckpts.directory / "corrupt-12").is_dir(), notices


def test_a_renamed_step_folder_is_set_aside_by_its_state_and_generate_refuses_it(reference, tmp_path):
    ckpts, spec, notices = _copy_checkpoints(reference, tmp_path)
    ckpts.path(12).rename(ckpts.path(60))  # meta and state both say 12
    meta = ckpts.path(60) / "meta" / "metadata"
    r = invoke("generate", "--checkpoint", str(ckpts.directory), "--prompt-ids", "1", "--ids")
    assert r.exit_code == 2 and "is damaged: meta says step 12, but the folder is named 60" in r.output, r.output
    meta.write_text(json.dumps(json.loads(meta.read_text()) | {"step": 60}))  # the meta edited to match
    ckpts._manager.reload()
    assert ckpts.restore_latest(spec).step == 10
    assert "its state is at step 12, but the folder is named 60" in notices[0], notices


def test_a_file_where_a_step_folder_goes_is_set_aside_not_overwritten(reference, tmp_path):
    ckpts, spec, notices = _copy_checkpoints(reference, tmp_path)
    restored = ckpts.restore_latest(spec)
    (ckpts.directory / "14").write_text("my notes")
    ckpts.save(14, restored.state, position=restored.position, seed=0, config_toml=restored.config_toml)
    ckpts.wait()
    assert (ckpts.directory / "corrupt-14").read_text() == "my notes"
    assert notices == [f"{ckpts.path(14)} is a file, not a checkpoint step folder; set aside as corrupt-14"]
    assert ckpts.steps()[-1] == 14 and (ckpts.path(14) / "state").is_dir()


def test_a_checkpoint_that_reads_back_other_than_saved_is_set_aside(reference, tmp_path):
    """A stored chunk damaged in a way that still decompresses was loaded in silence (a flipped bit gave a
    dead model, or a NaN two steps after every resume). Each save keeps a checksum per leaf; here the
    saved one is changed, as a flipped bit in the data would change what is read."""
    from shard.sharding.rules import path_str

    ckpts, spec, notices = _copy_checkpoints(reference, tmp_path)
    meta = ckpts.path(12) / "meta" / "metadata"
    doc = json.loads(meta.read_text())
    assert set(doc["fingerprint"]) == {path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(spec.abstract)[0]}
    doc["fingerprint"]["opt_state/1/0/mu/embed"][0] ^= 1 << 7
    meta.write_text(json.dumps(doc))
    assert ckpts.restore_latest(spec).step == 10
    assert "opt_state/1/0/mu/embed reads back other than it was saved (checksum mismatch)" in notices[0]
    assert (ckpts.directory / "corrupt-12").is_dir()
    # export reads the params on the host and checks them too: a parameter's checksum, changed
    meta = ckpts.path(10) / "meta" / "metadata"
    doc = json.loads(meta.read_text())
    doc["fingerprint"]["params/final_norm"][0] ^= 1
    meta.write_text(json.dumps(doc))
    r = invoke("export", "--checkpoint", str(ckpts.path(10)), "--out", str(tmp_path / "out"))
    assert r.exit_code == 2 and "params/final_norm reads back other than it was saved" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_a_resume_that_casts_the_state_is_no_checksum_mismatch(reference, tmp_path):
    """Checksums are compared for the leaves read back in the dtype they were saved in: with another
    model.param_dtype every checkpoint in turn was set aside as corrupt."""
    cfg, _, _, _ = reference
    ckpts, _, notices = _copy_checkpoints(reference, tmp_path)
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, param_dtype="bfloat16"))
    layout = make_layout(other, parse_mesh(other.mesh.spec), devices_for(other.mesh.spec))
    restored = ckpts.restore_latest(state_spec(other.model, other.optimizer, other.steps, layout))
    assert restored.step == 12 and notices == [] and restored.state["params"]["embed"].dtype == jax.numpy.bfloat16


def test_a_fingerprint_sees_one_flipped_bit_and_not_the_sharding_and_the_host_agrees():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shard.run.checksums import host_fingerprint, state_fingerprint

    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    flipped = x.copy()
    flipped.view(np.uint32)[5, 3] ^= 1 << 20
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    whole = state_fingerprint({"w": x})["w"]
    assert whole == state_fingerprint({"w": jax.device_put(x, NamedSharding(mesh, P("data", "model")))})["w"]
    assert whole[1] == "float32" and state_fingerprint({"w": flipped})["w"] != whole
    assert state_fingerprint({"w": swapped})["w"] != whole
    # the host's sum (export, generate), in blocks smaller than the array, for every dtype a state holds
    for leaf in (x, x.astype(jax.numpy.bfloat16), np.arange(37, dtype=np.int32), np.int32(7)):
        assert host_fingerprint(np.asarray(leaf), block=16) == state_fingerprint({"a": leaf})["a"][0], leaf.dtype


def test_a_sharded_fingerprint_sums_each_shard_in_slices_and_agrees_with_the_host():
    """Each device sums its own shard, a few rows at a time (the last slice moved back and masked), at its
    global positions: the same checksum as the host's for leaves split on the leading dim, on two axes,
    and replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shard.run.checksums import host_fingerprint, state_fingerprint

    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    rng = np.random.default_rng(1)
    leaves = {"stack": (rng.standard_normal((10, 8, 3)).astype(np.float32), P("data", "model")),
              "rows": (rng.standard_normal((16, 3)).astype(jax.numpy.bfloat16), P(("data", "model"))),
              "replicated": (np.arange(35, dtype=np.int32).reshape(7, 5), P()),
              "scalar": (np.int32(7), P())}
    state = {k: jax.device_put(x, NamedSharding(mesh, spec)) for k, (x, spec) in leaves.items()}
    want = {k: [host_fingerprint(np.asarray(x)), str(x.dtype)] for k, (x, _) in leaves.items()}
    assert state_fingerprint(state, slice_elements=12) == want  # (5, 2, 3) shards: slices of 2 rows
    assert state_fingerprint(state) == want


def test_a_corrupt_checkpoint_is_one_line_on_the_command_line(reference, tmp_path):
    """generate reads the newest step: its error is one line, without orbax's closed-loop tracebacks."""
    ckpts, _, _ = _copy_checkpoints(reference, tmp_path)
    for f in (ckpts.path(12) / "state" / "d").iterdir():
        f.write_bytes(b"garbage")
    r = subprocess.run([sys.executable, "-m", "shard", "generate", "--checkpoint", str(ckpts.directory),
                        "--prompt-ids", "1", "--ids", "--max-new-tokens", "1"],
                       capture_output=True, text=True, env=subprocess_env(1), timeout=300)
    assert r.returncode == 2, r.stderr
    assert "cannot read checkpoint" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_damaged_newest_step_is_named_not_skipped(reference, tmp_path):
    from shard.run.checkpoint import find_checkpoint

    ckpts, _, _ = _copy_checkpoints(reference, tmp_path)
    shutil.rmtree(ckpts.path(12) / "state")
    with pytest.raises(ShardError, match=r"newest checkpoint .*/12 is damaged \(no state/\); pass an older"):
        find_checkpoint(ckpts.directory)
    assert find_checkpoint(ckpts.path(10)) == (ckpts.directory, 10)
    shutil.rmtree(ckpts.path(12))
    (ckpts.directory / "2025").write_text("a stray file, not a step")
    assert find_checkpoint(ckpts.directory) == (ckpts.directory, 10)
    ckpts.path(10).rename(ckpts.directory / "corrupt-10")  # as a resume sets one aside
    with pytest.raises(ShardError, match=r"corrupt-10 is a checkpoint step that was set aside as damaged"):
        find_checkpoint(ckpts.directory / "corrupt-10")


def test_closed_loop_callbacks_are_dropped_and_other_unraisables_kept(monkeypatch):
    from types import SimpleNamespace

    from shard.run.orbax_quiet import _drop_closed_loop_callbacks

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda args: seen.append(str(args.exc_value)))
    _drop_closed_loop_callbacks()
    for error in (RuntimeError("Event loop is closed"), RuntimeError("other"), ValueError("x")):
        sys.unraisablehook(SimpleNamespace(exc_type=type(error), exc_value=error, object=None))
    # a read that failed inside an orbax coroutine nobody awaits any more; and one of someone else's
    orbax_read = SimpleNamespace(cr_code=SimpleNamespace(co_filename="/site-packages/orbax/checkpoint/x.py"))
    mine = SimpleNamespace(cr_code=SimpleNamespace(co_filename="/work/mine.py"))
    for coroutine, error in ((orbax_read, ValueError("read")), (mine, ValueError("mine"))):
        sys.unraisablehook(SimpleNamespace(exc_type=ValueError, exc_value=error, object=coroutine))
    assert seen == ["other", "x", "mine"]


def test_incomplete_save_is_ignored_and_cleaned_with_a_notice(reference, tmp_path):
    ckpts, spec, notices = _copy_checkpoints(reference, tmp_path)
    shutil.copytree(ckpts.path(12), ckpts.directory / f"14{TMP_MARK}")  # a save killed before its rename
    restored = ckpts.restore_latest(spec)
    assert restored.step == 12
    assert notices == [f"removing incomplete checkpoint 14{TMP_MARK} (a save that never finished)"]
    assert not ckpts.incomplete()


def test_empty_checkpoint_dir(reference, tmp_path):
    _, spec, _ = _copy_checkpoints(reference, tmp_path / "x")
    with pytest.raises(ShardError, match="no complete checkpoint in"):
        request_close(Checkpoints(tmp_path / "empty")).restore_latest(spec)


def test_export_writes_params_that_plain_orbax_reads(reference, tmp_path):
    _, _, final_state, ckpts = reference
    result = CliRunner().invoke(app, ["export", str(ckpts.directory.parent),  # positional, as export-hf
                                      "--out", str(tmp_path / "params")])
    assert result.exit_code == 0, result.output
    assert f"step {STEPS}" in result.output
    params = ocp.StandardCheckpointer().restore(tmp_path / "params")  # no shard, no target tree
    assert_trees_equal(params, final_state["params"])
    again = CliRunner().invoke(app, ["export", "--checkpoint", str(ckpts.directory.parent),
                                     "--out", str(tmp_path / "params")])
    assert again.exit_code == 2 and "not an empty folder" in again.output
    read_back = CliRunner().invoke(app, ["export", "--checkpoint", str(tmp_path / "params"), "--out",
                                         str(tmp_path / "again")])
    assert read_back.exit_code == 2 and "is a plain orbax checkpoint (what shard export writes)" in read_back.output


def test_export_under_a_file_is_one_line_and_exits(reference, tmp_path):
    """A file where --out's parent folder belongs: orbax's save thread used to fail there and leave
    threads waiting for ever, so the process printed a traceback and an error, then never exited."""
    _, _, _, ckpts = reference
    (tmp_path / "afile").touch()
    done = subprocess.run([sys.executable, "-m", "shard", "export", "--checkpoint", str(ckpts.directory.parent),
                           "--out", str(tmp_path / "afile" / "params")],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'afile' / 'params'}: Not a directory", \
        done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_a_failed_export_leaves_no_partial_folder(reference, tmp_path, monkeypatch):
    import errno

    import shard.run.stored as stored_mod

    class DiskFills:  # what orbax does on a full disk: a temporary folder, then the error
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def save(self, out, params):
            Path(f"{out}{TMP_MARK}-1700000000").mkdir()
            raise OSError(errno.ENOSPC, "No space left on device", str(out))

    monkeypatch.setattr(stored_mod.ocp, "StandardCheckpointer", DiskFills)
    _, _, _, ckpts = reference
    (tmp_path / "exports").mkdir()  # there before: stays
    result = invoke("export", "--checkpoint", str(ckpts.directory.parent), "--out",
                    str(tmp_path / "exports" / "new" / "deeper" / "params"))
    assert result.exit_code == 2 and "No space left on device" in result.output, result.output
    assert [p.name for p in tmp_path.rglob("*")] == ["exports"]  # and not the folders made for it


def test_export_into_a_runs_checkpoints_folder_is_refused(reference, tmp_path):
    """It would be read as the run's newest checkpoint (and found damaged) by resume, generate, export."""
    _, _, _, ckpts = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ckpts.directory.parent, run_dir)
    result = invoke("export", "--checkpoint", str(run_dir), "--out", str(run_dir / CHECKPOINTS_DIR / "99"))
    assert result.exit_code == 2 and "is in the checkpoints folder of the run in" in result.output, result.output
    assert sorted(p.name for p in (run_dir / CHECKPOINTS_DIR).iterdir()) == \
        sorted(p.name for p in ckpts.directory.iterdir())


@pytest.mark.parametrize("flag, label", [("--run-dir", "run dir"), ("--compile-cache", "compile cache")])
def test_a_train_writing_into_a_runs_checkpoints_folder_is_refused(reference, tmp_path, flag, label):
    """The run's next resume would read the folder as its newest checkpoint and set it aside as corrupt."""
    _, _, _, ckpts = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ckpts.directory.parent, run_dir)
    inside = run_dir / CHECKPOINTS_DIR / "11"
    extra = [] if flag == "--run-dir" else ["--run-dir", str(tmp_path / "other")]
    result = invoke("train", *TINY, flag, str(inside), *extra)
    assert result.exit_code == 2, result.output
    assert f"{label} {inside} is in the checkpoints folder of the run in {run_dir}" in result.output, result.output
    assert sorted(p.name for p in (run_dir / CHECKPOINTS_DIR).iterdir()) == \
        sorted(p.name for p in ckpts.directory.iterdir())


# -- the CLI's bad inputs: each one line, exit 2, nothing deleted --------------------------------------

TINY = ["--model", "tiny", "--steps", "2", "--batch", "8", "--seq", "32", "--mesh", "2x4"]


def invoke(*args):
    return CliRunner().invoke(app, list(args))


def test_resume_without_a_checkpoint(tmp_path):
    missing = invoke("train", *TINY, "--run-dir", str(tmp_path / "nope"), "--resume")
    assert missing.exit_code == 2 and "does not exist" in missing.output
    (tmp_path / "empty").mkdir()
    empty = invoke("train", *TINY, "--run-dir", str(tmp_path / "empty"), "--resume")
    assert empty.exit_code == 2 and "no complete checkpoint" in empty.output and "--allow-fresh" in empty.output
    assert len(empty.output.strip().splitlines()) == 1
    no_dir = invoke("train", *TINY, "--resume")
    assert no_dir.exit_code == 2 and "--resume needs --run-dir" in no_dir.output


def test_run_dir_of_another_config_without_resume(tmp_path):
    cfg = tiny_config("2x4", steps=2, model__d_model=32)
    (tmp_path / "config.toml").write_text(config_mod.to_toml(cfg))
    result = invoke("train", *TINY, "--run-dir", str(tmp_path))
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "belongs to a different config (model.d_model is 32 there, 64 here)" in result.output
    same = tiny_config("2x4", steps=2, data__batch=8, data__seq_len=32, log_every=10)
    (tmp_path / "config.toml").write_text(config_mod.to_toml(same))
    again = invoke("train", *TINY, "--run-dir", str(tmp_path))
    assert again.exit_code == 2 and "holds a run that never logged a step" in again.output  # nothing to resume
    assert (tmp_path / "config.toml").read_text() == config_mod.to_toml(same)  # untouched


def test_resume_without_config_toml_uses_the_checkpoints_copy(reference, tmp_path):
    """A lost config.toml used to resume the default model (then a shape mismatch); each checkpoint
    keeps the config it was saved with."""
    _, _, _, ckpts = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ckpts.directory.parent, run_dir)
    (run_dir / "config.toml").unlink()
    result = invoke("train", "--run-dir", str(run_dir), "--resume")
    assert result.exit_code == 0, result.output
    assert f"config.toml is missing: using the config saved with checkpoint {STEPS}" in result.output
    assert "nothing to do: the checkpoint is at step" in result.output
    shorter = invoke("train", "--run-dir", str(run_dir), "--resume", "--steps", str(STEPS // 2))
    assert shorter.exit_code == 0 and "nothing to do: the checkpoint is at step" in shorter.output
    assert "schedule" not in shorter.output, shorter.output  # a change that nothing trains with is not said
    (tmp_path / "afile").touch()
    a_file = invoke("train", "--run-dir", str(tmp_path / "afile"), "--resume")
    assert a_file.exit_code == 2 and "is a file" in a_file.output


def test_a_run_dir_in_use_is_refused_before_anything_is_removed(reference, tmp_path):
    """A second train into a run dir that a running train holds: one line, and the running one's save
    in progress (an unfinished step folder) is not taken for a dead save and removed. Once the lock is
    free, --resume goes on (and cleans it)."""
    _, _, _, ckpts = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ckpts.directory.parent, run_dir)
    in_progress = run_dir / CHECKPOINTS_DIR / f"{STEPS + 2}{TMP_MARK}"
    in_progress.mkdir()
    held = RunDirLock(run_dir)
    held.acquire()
    try:
        for args in (["--resume"], ["--resume", "--allow-fresh"], []):  # [] once said "already holds a run"
            result = invoke("train", "--run-dir", str(run_dir), *args)
            assert result.exit_code == 2 and result.output.count("error:") == 1, result.output
            assert f"run dir {run_dir} is in use by another shard train (pid {os.getpid()} on " in result.output
        assert in_progress.is_dir()
    finally:
        held.release()
    done = invoke("train", "--run-dir", str(run_dir), "--resume")
    assert done.exit_code == 0 and "nothing to do" in done.output, done.output
    assert not in_progress.exists()
    assert not (run_dir / ".lock").exists()  # released, and its file removed


# -- real processes: elastic restart on other device counts, SIGTERM, kill -9 ------------------------

def shard_process(*args, devices: int | None = None) -> subprocess.Popen:
    """The `shard` CLI in a fresh process (its own device count), output captured."""
    env = subprocess_env()  # the CLI sets the device count
    if devices:
        args = (*args, "--simulate-devices", str(devices))
    return subprocess.Popen([sys.executable, "-m", "shard", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    return finish_all([p], timeout)[0]


def logged_losses(run_dir) -> dict[int, float]:
    """Loss by step from metrics.jsonl; a step logged again after a resume keeps its last record."""
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


def test_elastic_restart_on_fewer_processes_devices_and_other_meshes(reference, tmp_path):
    _, ref_losses, _, ckpts = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ckpts.directory.parent, run_dir, ignore=shutil.ignore_patterns("[6-9]", "1[0-9]"))
    # 2x4 on 8 devices -> 4x1 on 4 devices, from step 4 (the config comes from the run dir)
    rc, out, err = finish(shard_process("train", "--run-dir", str(run_dir), "--resume", "--mesh", "4x1", devices=4))
    assert rc == 0, err
    assert "resumed from step 4" in err and "mesh data=4,model=1 on 4 cpu device(s)" in out
    # -> 1x1 on one device, from step 8 (saved by the 4-device run)
    for late in ("10", "12"):
        shutil.rmtree(run_dir / CHECKPOINTS_DIR / late)
    rc, out, err = finish(shard_process("train", "--run-dir", str(run_dir), "--resume", "--mesh", "1x1", devices=1))
    assert rc == 0, err
    assert "resumed from step 8" in err and "on 1 cpu device(s)" in out
    losses = logged_losses(run_dir)
    np.testing.assert_allclose([losses[s] for s in range(5, STEPS + 1)], ref_losses[4:], rtol=1e-5)


def test_sigterm_and_kill_9_at_random_moments_then_resume_continues_exactly(reference, tmp_path):
    """Every restart resumes from the newest complete checkpoint; the stitched run equals the
    uninterrupted one bitwise. One trial kills the trainer while an async save is being written."""
    _, ref_losses, _, _ = reference
    run_dir = tmp_path / "run"  # not there yet: --resume --allow-fresh is also right for the first start
    ckpt_dir = run_dir / CHECKPOINTS_DIR
    args = ["train", "--run-dir", str(run_dir), "--resume", "--allow-fresh", "--model", "tiny", "--mesh", "2x4",
            "--steps", str(STEPS), "--batch", "8", "--seq", "32", "--log-every", "1", "--checkpoint-every", "1",
            "--keep", "2"]
    rng = random.Random(5)

    def lines() -> int:
        path = run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def start_and_wait_for_training() -> subprocess.Popen:
        before = lines()
        p = shard_process(*args)
        while lines() == before and p.poll() is None:
            time.sleep(0.005)
        return p

    def complete_steps() -> list[int]:
        return sorted(int(c.name) for c in ckpt_dir.iterdir() if c.name.isdigit()) if ckpt_dir.exists() else []

    p = start_and_wait_for_training()  # 1. preemption: SIGTERM saves the current step and exits 0
    p.send_signal(signal.SIGTERM)
    rc, out, err = finish(p)
    assert rc == 0, err
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+)", out).group(1))
    assert f"checkpoint saved to {ckpt_dir / str(stopped)}" in out.replace("\n", "")
    assert complete_steps()[-1] == stopped

    # 2. kill -9 while a save is written: the trainer kills itself as orbax is about to rename the save
    # it wrote into place, so the unfinished save is there, not a matter of timing
    newest = complete_steps()[-1]
    rc, out, err = finish(subprocess.Popen([sys.executable, str(Path(__file__).parent / "helpers" / "killed_in_save.py"),
                                            *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           env=subprocess_env()))
    assert rc == -signal.SIGKILL and f"resumed from step {newest} " in err, err
    unfinished = [c.name for c in ckpt_dir.iterdir() if TMP_MARK in c.name]
    assert len(unfinished) == 1 and unfinished[0].startswith(f"{newest + 1}{TMP_MARK}"), unfinished
    assert complete_steps()[-1] == newest

    newest = complete_steps()[-1]  # 3. kill -9 at a random moment
    p = start_and_wait_for_training()
    time.sleep(rng.uniform(0, 0.3))
    p.kill()
    rc, out, err = finish(p)
    assert f"resumed from step {newest} " in err, err
    assert rc == -signal.SIGKILL or (rc == 0 and "done: " in out), (rc, err)  # or it had ended first

    newest = complete_steps()[-1]
    rc, out, err = finish(shard_process(*args))  # 4. the last restart runs to the end
    assert rc == 0, err
    assert f"resumed from step {newest} " in err
    losses = logged_losses(run_dir)
    assert [losses[s] for s in range(1, STEPS + 1)] == ref_losses  # bitwise


def test_two_processes_resume_stop_together_and_one_process_continues_their_checkpoint(reference, tmp_path):
    """1 process (2x4) -> 2 processes x 4 devices (2x4, jax.distributed; only one gets SIGTERM, both
    stop after the same step and save it) -> 1 process (8x1) continues to the end."""
    cfg, ref_losses, _, ckpts = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ckpts.directory.parent, run_dir, ignore=shutil.ignore_patterns("[5-9]", "1[0-9]"))
    port = free_ports()[0]
    env = subprocess_env()  # the helper sets the device count
    script = Path(__file__).parent / "helpers" / "two_process_resume.py"
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port), str(run_dir), str(STEPS), "8"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    outputs = finish_all(procs, 300)  # a hang kills both
    for rc, _, err in outputs:
        assert rc == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in outputs]
    assert [r["start_step"] for r in results] == [4, 4]
    assert [r["stopped_at"] for r in results] == [8, 8]  # agreed, though only process 1 got the signal
    np.testing.assert_allclose(results[0]["losses"], ref_losses[4:8], rtol=1e-5)
    # The processes wrote one checkpoint together (on 2x4 the parameters are replicated across the two
    # processes, so orbax has replica 0, on process 0, write each small array); one process reads it
    # into 8x1 and continues.
    written = sorted(p.name for p in (run_dir / CHECKPOINTS_DIR / "8" / "state").glob("ocdbt.process_*"))
    assert "ocdbt.process_0" in written and set(written) <= {"ocdbt.process_0", "ocdbt.process_1"}
    other = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, spec="8x1"))
    losses, run, ckpts2 = checkpointed_run(run_dir, other, restore=lambda c: c.restore_latest)
    request_close(ckpts2)
    assert run.start_step == 8
    np.testing.assert_allclose(losses, ref_losses[8:], rtol=1e-5)


def test_a_checkpoint_folder_that_is_not_writable_is_named_before_training(reference, tmp_path, monkeypatch):
    """On a read-only mount the run trained up to its first save, then failed there; reading stays open
    to generate and export (without orbax's read-only warnings)."""
    import shard.run.checkpoint as checkpoint_mod

    _, _, _, ckpts = reference
    monkeypatch.setattr(checkpoint_mod.os, "access", lambda path, mode: mode != os.W_OK)
    with pytest.raises(ShardError, match=r"checkpoint folder \S+ is not writable \(a read-only mount"):
        Checkpoints(ckpts.directory)
    request_close(Checkpoints(ckpts.directory, read_only=True))


def test_orbax_ends_a_restore_in_a_device_barrier():
    """read_failures.read_outcomes releases the processes waiting in orbax's closing barrier by meeting it
    with a device collective; that holds while orbax's coordination-service barrier is off (its flag's
    default; shard never parses absl flags). A newer orbax that turns it on must fail here, not hang."""
    from orbax.checkpoint._src.multihost import multihost

    assert multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.default is False


# -- local snapshots (checkpoint.local_every) -------------------------------------------------------

def test_a_kill_9_loses_at_most_local_every_steps_and_a_finished_run_leaves_no_snapshot(reference, tmp_path):
    """Durable saves far apart, a local snapshot (in /dev/shm) every 2 steps: the trainer killed while the
    snapshot of step 6 is written (so past step 5) resumes from the snapshot of step 4, not from step 0,
    and removes the unfinished one; the stitched curve is the uninterrupted one, bitwise. Having finished,
    the run leaves no snapshot behind."""
    from shard.run.snapshots import snapshot_folder

    _, ref_losses, _, _ = reference
    run_dir = tmp_path / "run"
    folder = snapshot_folder("auto", run_dir)
    args = ["train", "--run-dir", str(run_dir), "--resume", "--allow-fresh", "--model", "tiny", "--mesh", "2x4",
            "--steps", str(STEPS), "--batch", "8", "--seq", "32", "--log-every", "1", "--checkpoint-every", "1000",
            "--set", "checkpoint.local_every=2"]
    killed = [sys.executable, str(Path(__file__).parent / "helpers" / "killed_in_save.py"), *args]
    try:
        rc, _, err = finish(subprocess.Popen(killed, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                             env=subprocess_env(SHARD_TEST_KILL_AT=f"{re.escape(str(folder))}/6$")))
        assert rc == -signal.SIGKILL, err
        assert [p.name.split(TMP_MARK)[0] for p in sorted(folder.iterdir())] == ["4", "6"]  # 6 unfinished
        assert not (run_dir / CHECKPOINTS_DIR).exists()  # no durable save yet
        rc, out, err = finish(shard_process(*args))
        assert rc == 0, err
        assert re.search(rf"removing incomplete local snapshot 6{re.escape(TMP_MARK)}\S* \(a save that never", err)
        assert f"resumed from step 4 (local snapshot {folder / '4'}), data position 32\n" in err, err
        losses = logged_losses(run_dir)
        assert [losses[s] for s in range(1, STEPS + 1)] == ref_losses  # bitwise
        assert not folder.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _snapshot_beside_checkpoints(reference, tmp_path, newest: int = 8):
    """The reference's checkpoints up to `newest` in tmp_path, and its checkpoint `newest` + 2 as the
    run's local snapshot: (checkpoints, snapshots, spec, notices)."""
    from shard.run.snapshots import Snapshots

    ckpts, spec, notices = _copy_checkpoints(reference, tmp_path)
    (tmp_path / "snapshots").mkdir()
    ckpts.path(newest + 2).rename(tmp_path / "snapshots" / str(newest + 2))  # a snapshot is a checkpoint
    for late in ckpts.steps()[ckpts.steps().index(newest) + 1:]:
        if ckpts.path(late).exists():
            shutil.rmtree(ckpts.path(late))
    ckpts.reload()
    every_2 = dataclasses.replace(reference[0].checkpoint, local_every=2)
    snapshots = Snapshots(tmp_path / "snapshots", every_2, notices.append, holds=True)
    request_close(snapshots.store)
    return ckpts, snapshots, spec, notices


def test_resume_reads_a_snapshot_newer_than_the_checkpoints(reference, tmp_path):
    from shard.run.resume import NewestState

    ckpts, snapshots, spec, notices = _snapshot_beside_checkpoints(reference, tmp_path)
    restore = NewestState(ckpts, snapshots, None, 0, notices.append)
    restored = restore(spec)
    assert (restored.step, restored.position) == (10, 10 * 8) and notices == []
    assert restore.where == f"local snapshot {snapshots.folder / '10'}"
    assert_trees_equal(restored.state, ckpts_state_at(reference, 10))


def test_a_fresh_start_removes_the_snapshots_an_earlier_run_left(reference, tmp_path):
    """A run dir removed by hand leaves its snapshots in /dev/shm: a new run there must not resume them."""
    from shard.run.resume import restore_source

    ckpts, snapshots, _, notices = _snapshot_beside_checkpoints(reference, tmp_path)
    assert restore_source(ckpts, False, False, "", 0, notices.append, snapshots) is None  # the init
    assert notices == [f"removing the local snapshots in {snapshots.folder}: an earlier run in this run dir left "
                       "them, and this one starts from step 0"]
    assert not snapshots.folder.exists()


def ckpts_state_at(reference, step):
    cfg, _, _, ckpts = reference
    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices_for(cfg.mesh.spec))
    return jax.device_get(ckpts.restore(step, state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)).state)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's closed loop, as above
@pytest.mark.parametrize("damage", ["garbage", "on another host"])
def test_a_snapshot_that_cant_be_read_falls_back_to_the_checkpoint_and_stays(reference, tmp_path, monkeypatch,
                                                                             damage):
    """Damaged files, or a snapshot that one process of the job does not find (its folder is another
    host's): the restore falls back to the durable checkpoint in one line; the snapshot is neither set
    aside as corrupt nor removed, and the checkpoints are untouched."""
    import shard.run.snapshots as snapshots_mod
    from shard.run.resume import NewestState

    ckpts, snapshots, spec, notices = _snapshot_beside_checkpoints(reference, tmp_path)
    if damage == "garbage":
        for f in (snapshots.folder / "10" / "state" / "d").iterdir():
            f.write_bytes(b"garbage")
        why = r"[^()]*(\([^()]*\)[^()]*)*"  # the read's error: a line of orbax's or tensorstore's
    else:  # process 1 finds no snapshot in the folder
        from types import SimpleNamespace

        real = snapshots_mod.exchange
        monkeypatch.setattr(snapshots_mod, "exchange", SimpleNamespace(
            gather_text=lambda text: [text, "[]"], broadcast_text=real.broadcast_text, barrier=real.barrier,
            any_process=real.any_process))
        why = re.escape(f"it is not in {snapshots.folder} on process 1")
    restored = NewestState(ckpts, snapshots, None, 0, notices.append)(spec)
    assert restored.step == 8
    assert len(notices) == 1 and re.fullmatch(rf"local snapshot at step 10 can't be read \({why}\): resuming from "
                                              r"checkpoint 8", notices[0]), notices
    assert step_dirs(snapshots.folder) == [10] and sorted(p.name for p in snapshots.folder.iterdir()) == ["10"]
    assert ckpts.steps() == [2, 4, 6, 8] and not list(ckpts.directory.glob("corrupt-*"))
    if damage == "garbage":  # the run goes on from 8: its own snapshot of step 10 takes the old one's place
        from shard.run.snapshots import SaveSnapshots

        cfg, ref_losses, _, _ = reference
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, every=0, local_every=2))
        run = prepare(cfg, devices_for(cfg.mesh.spec), restore=lambda spec: restored)
        saver = SaveCheckpoints(ckpts, seed=cfg.seed, config_toml="")
        snapshotter = SaveSnapshots(snapshots, saver, seed=cfg.seed, config_toml="")
        records = train(cfg, run=run, observers=[snapshotter, saver])
        assert [r["loss"] for r in records] == ref_losses[8:]
        assert not snapshots.folder.exists() and len(notices) == 1  # finished: its snapshots removed


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's closed loop, as above
def test_an_unreadable_snapshot_and_no_checkpoint_start_again_only_with_allow_fresh(reference, tmp_path):
    from shard.run.resume import NewestState

    ckpts, snapshots, spec, notices = _snapshot_beside_checkpoints(reference, tmp_path)
    shutil.rmtree(ckpts.directory)
    ckpts.reload()
    for f in (snapshots.folder / "10" / "state" / "d").iterdir():
        f.write_bytes(b"garbage")
    with pytest.raises(ShardError, match=r"^--resume: local snapshot at step 10 can't be read \(.+\), and \S+ holds "
                                         r"no checkpoint; --resume --allow-fresh starts this run again from step 0$"):
        NewestState(ckpts, snapshots, None, 0, notices.append)(spec)
    restored = NewestState(ckpts, snapshots, lambda: None, 0, notices.append)(spec)  # --allow-fresh, no init_from
    assert (restored.step, restored.position, restored.config_toml) == (0, 0, "")
    assert len(notices) == 1 and re.fullmatch(r"local snapshot at step 10 can't be read \(.+\): starting from step 0",
                                              notices[0])
    assert step_dirs(snapshots.folder) == [10]


def test_snapshots_go_to_the_ram_disk_by_run_dir_or_to_the_run_dir_and_need_room_for_two(tmp_path, monkeypatch):
    from shard.run.snapshots import Snapshots, snapshot_folder

    ram, run_dir = tmp_path / "shm", tmp_path / "runs" / "a"
    ram.mkdir()
    folder = snapshot_folder("auto", run_dir, ram_disk=ram)
    assert folder.parent == ram / "shard-snapshots" and len(folder.name) == 16
    assert snapshot_folder("auto", tmp_path / "runs" / ".." / "runs" / "a", ram_disk=ram) == folder
    assert snapshot_folder("auto", tmp_path / "runs" / "b", ram_disk=ram) != folder
    assert snapshot_folder("auto", run_dir, ram_disk=tmp_path / "no-ram-disk") == run_dir / "snapshots"
    monkeypatch.chdir(tmp_path)
    assert snapshot_folder("snaps", run_dir, ram_disk=ram) == tmp_path / "snaps"
    unfit = Snapshots(folder, CheckpointConfig(local_every=2), print, holds=False)
    request_close(unfit.store)
    assert unfit.unfit(2**10) is None and (ram / "shard-snapshots").stat().st_mode & 0o1777 == 0o1777
    assert re.fullmatch(rf"{re.escape(str(folder))} has room for \S+ [GM]iB, two snapshots \(one committed while "
                        r"the next is written\) take 2048.00 GiB", unfit.unfit(2**40))


def test_a_stopped_run_keeps_its_snapshot_and_a_finished_one_removes_it(reference, tmp_path):
    """SIGTERM at step 5: the durable save of step 5 and the snapshot of step 4 stay. The resume reads
    the newer checkpoint, replaces the old snapshot with its own and, at --steps, removes them all."""
    from shard.run.resume import restore_source
    from shard.run.snapshots import SaveSnapshots, open_snapshots, snapshot_folder

    cfg, ref_losses, _, _ = reference
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path), checkpoint=dataclasses.replace(cfg.checkpoint, every=0,
                                                                                          local_every=2))
    toml, notices, folder = config_mod.to_toml(cfg), [], snapshot_folder("auto", tmp_path)

    def start(resume: bool, observers=()) -> tuple[list[float], object]:
        ckpts = request_close(Checkpoints(tmp_path / CHECKPOINTS_DIR, cfg.checkpoint, notice=notices.append))
        snapshots = open_snapshots(cfg.checkpoint, tmp_path, notices.append)
        request_close(snapshots.store)
        restore = restore_source(ckpts, resume, False, "", cfg.seed, notices.append, snapshots)
        run = prepare(cfg, devices_for(cfg.mesh.spec), restore=restore)
        saver = SaveCheckpoints(ckpts, seed=cfg.seed, config_toml=toml)
        snapshotter = SaveSnapshots(snapshots, saver, seed=cfg.seed, config_toml=toml)
        records = train(cfg, run=run, observers=[*observers, snapshotter, saver])
        assert snapshots.folder == folder
        return [r["loss"] for r in records], run

    try:
        first, run = start(False, [SignalAt(5), StopOnSignal()])
        assert run.stopped_at == 5 and step_dirs(folder) == [4] and step_dirs(tmp_path / CHECKPOINTS_DIR) == [5]
        second, run = start(True)
        assert run.start_step == 5 and first + second == ref_losses
        assert not folder.exists() and notices == []
    finally:
        shutil.rmtree(folder, ignore_errors=True)
