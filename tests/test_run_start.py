"""How a run starts, without the command line: the config a --resume or --init-from resolves, and the
run dir a start claims, locks, writes and (after a failed first start) forgets. Nothing trains here."""

import json

import pytest

from shard import config as config_mod
from shard.errors import ShardError
from shard.paths import RunDirLock
from shard.run.hf import config_to_hf
from shard.run.start import RunDirClaim, init_from_given, resolve_start, run_dir_named
from shard.testing import tiny_config


def flags(**top):
    """`layers` as the command line stacks them: these keys over the base."""
    return lambda base: config_mod.merge(base or {}, top)


def saved_run(tmp_path, **sets):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(config_mod.to_toml(tiny_config(run_dir=str(run), **sets)))
    return run


def hf_folder(tmp_path, positions: int):
    """A Hugging Face folder of the tiny model whose config.json says it was made for `positions`."""
    folder = tmp_path / "hf-tiny"
    folder.mkdir()
    hf_config = config_to_hf(tiny_config().model) | {"max_position_embeddings": positions}
    (folder / "config.json").write_text(json.dumps(hf_config))
    return folder


def test_a_resume_starts_from_the_saved_config_and_says_what_it_changes(tmp_path):
    run = saved_run(tmp_path)
    start = resolve_start(flags(steps=5), {}, None, run_dir=str(run), init_from=None, resume=True,
                          allow_fresh=False)
    assert start.resumed and start.weights == "" and start.base["model"]["name"] == "tiny"
    assert start.cfg.model == tiny_config().model and start.cfg.steps == 5 and start.cfg.run_dir == str(run)
    assert any(c.startswith("the learning-rate schedule changes (steps 3 -> 5)") for c in start.changes)
    # the run dir may come from the --config file instead
    named = run_dir_named(None, {"run_dir": str(run)}, resume=True)  # --resume with the run dir in --config
    assert named == str(run) and run_dir_named(None, {"run_dir": str(run)}, resume=False) is None
    from_file = resolve_start(flags(), {"run_dir": str(run)}, None, run_dir=named, init_from=None, resume=True,
                              allow_fresh=False)
    assert from_file.resumed and from_file.changes == ()


def test_a_resume_refuses_another_model_and_a_missing_run_dir(tmp_path):
    run = saved_run(tmp_path)
    with pytest.raises(ShardError, match=f"--resume continues the tiny run in {run}; model small can't be loaded"):
        resolve_start(flags(model={"name": "small"}), {}, None, run_dir=str(run), init_from=None, resume=True,
                      allow_fresh=False)
    with pytest.raises(ShardError, match="does not exist \\(--allow-fresh starts it when it doesn't\\)"):
        resolve_start(flags(), {}, None, run_dir=str(tmp_path / "none"), init_from=None, resume=True,
                      allow_fresh=False)
    fresh = resolve_start(flags(), {}, None, run_dir=str(tmp_path / "none"), init_from=None, resume=True,
                          allow_fresh=True)
    assert not fresh.resumed and fresh.base == {}


def test_init_from_builds_the_weights_model_with_absolute_paths_and_a_context_note(tmp_path, monkeypatch):
    hf_folder(tmp_path, positions=16)
    monkeypatch.chdir(tmp_path)
    notes = []
    start = resolve_start(flags(init_from="hf-tiny", data={"seq_len": 32}), {}, None, run_dir=None,
                          init_from="hf-tiny", resume=False, allow_fresh=False, notice=notes.append)
    assert not start.resumed and start.weights == "hf-tiny"
    assert start.cfg.model.name == "hf-tiny" and start.cfg.model.d_model == tiny_config().model.d_model
    assert start.cfg.init_from == str(tmp_path / "hf-tiny")  # absolute: a resume from elsewhere finds it
    assert len(notes) == 1 and f"data.seq_len 32 is beyond the 16 positions {tmp_path / 'hf-tiny'} was made" in notes[0]
    # a folder's model may be called by the preset it is, and by no other
    named = resolve_start(flags(init_from="hf-tiny", model={"name": "tiny"}), {}, None, run_dir=None,
                          init_from="hf-tiny", resume=False, allow_fresh=False)
    assert named.cfg.model.name == "tiny"
    with pytest.raises(ShardError, match="init_from hf-tiny is another model than small"):
        resolve_start(flags(init_from="hf-tiny", model={"name": "small"}), {}, None, run_dir=None,
                      init_from="hf-tiny", resume=False, allow_fresh=False)


def test_init_from_is_taken_from_set_over_the_flag_over_the_file():
    assert init_from_given("flag", {"init_from": "file"}, ["init_from=set"]) == "set"
    assert init_from_given("flag", {"init_from": "file"}, None) == "flag"
    assert init_from_given(None, {"init_from": "file"}, None) == "file"
    assert init_from_given(None, {}, None) == ""


def test_a_claim_makes_locks_and_writes_the_run_dir_and_the_weights_side_files(tmp_path):
    hf = hf_folder(tmp_path, positions=4096)
    path = tmp_path / "runs" / "new"
    claim = RunDirClaim(path, main=True)
    claim.hold()  # nothing there yet: locked once made
    assert not path.exists()
    claim.claim()
    with pytest.raises(ShardError, match="is in use by another shard train"):
        RunDirLock(path).check_free()
    claim.write_start("steps = 3\n", init_from=str(hf), first_start=True)
    assert (path / "config.toml").read_text() == "steps = 3\n" and (path / "hf" / "config.json").is_file()
    claim.release()
    RunDirLock(path).check_free()


def test_a_run_dir_another_train_started_meanwhile_is_not_claimed(tmp_path):
    path = tmp_path / "run"
    claim = RunDirClaim(path, main=True)
    path.mkdir()
    (path / "config.toml").write_text("steps = 3\n")  # the other start's
    try:
        with pytest.raises(ShardError, match="was started by another shard train while this one prepared"):
            claim.claim()
    finally:
        claim.release()
    assert (path / "config.toml").read_text() == "steps = 3\n"


def test_a_failed_first_start_forgets_what_it_wrote_and_keeps_what_was_there(tmp_path):
    path = tmp_path / "run"
    (path / "tb").mkdir(parents=True)  # the user's own
    claim = RunDirClaim(path, main=True)
    claim.hold()
    claim.claim()
    claim.write_start("steps = 3\n")
    (path / "metrics.jsonl").touch()  # no step logged yet
    claim.forget_unstarted()
    claim.release()
    assert sorted(p.name for p in path.iterdir()) == ["tb"]


def test_the_other_processes_claim_and_write_nothing(tmp_path):
    path = tmp_path / "run"
    claim = RunDirClaim(path, main=False)
    claim.hold()
    claim.claim()
    claim.write_start("steps = 3\n")
    claim.forget_unstarted()
    assert not path.exists()


def test_a_first_start_the_full_disk_stops_names_the_file_and_leaves_no_run_dir(tmp_path, monkeypatch):
    """config.toml's write failed in fsync, as a full disk fails it: "error: OSError: [Errno 28] No space
    left on device" named no file, and an empty run dir stayed behind."""
    import errno
    import os

    from shard.cli.app import user_error

    claim = RunDirClaim(tmp_path / "runs" / "a", main=True)
    claim.hold()
    claim.claim()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        claim.write_start("seed = 0\n")
    assert str(user_error(e.value)) == f"{tmp_path / 'runs' / 'a' / 'config.toml'}: No space left on device"
    claim.forget_unstarted()
    claim.release()
    assert list(tmp_path.iterdir()) == []


def test_the_sp_presets_start_up_line_says_sequence_parallelism_is_on():
    from shard.observe.progress import sequence_parallel
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.testing import devices_for, tiny_config

    def said(mesh):
        return sequence_parallel(make_layout(tiny_config(mesh), parse_mesh(mesh), devices_for(mesh)))

    assert said("sp") == " · sequence parallel: norms and residual adds split along length on model=2"
    assert said("tp") == ""


def test_a_run_dir_whose_metrics_hold_only_a_supervisors_events_holds_no_run_yet(tmp_path):
    """shard launch writes its launch_start event before the first start logs a step: that (or a torn line)
    is no run yet, one step record is."""
    from shard.run.run_dir import has_records

    run = tmp_path / "r"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    metrics.write_text(json.dumps({"event": "launch_start", "time": 1.0, "processes": 2}) + "\n{\"step\": 1, \"lo\n")
    assert not has_records(run)
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": 1, "loss": 5.0, "time_s": 0.1}) + "\n")
    assert has_records(run)
