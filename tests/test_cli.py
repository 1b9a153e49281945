"""The command line: bad input is one line and exit code 2; device simulation; train and inspect end to end."""

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shard import config
from shard.cli.app import app

TINY = ["--model", "tiny", "--steps", "2", "--batch", "8", "--seq", "32"]


def invoke(*args):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("args, message", [
    (["--mesh", "4x4"], "needs 16 devices but 8 exist"),
    (["--mesh", "foo=8"], "unknown mesh axis 'foo'"),
    (["--mesh", "nonesuch"], "unknown mesh 'nonesuch'"),
    (["--mesh", "1x8", "--set", "model.mlp_dim=100"],
     "parameter layers/w_down (2, 100, 64): dimension 1 (mlp) of size 100 does not divide by mesh axis model=8"),
    (["--mesh", "8x1", "--batch", "6"], "global batch 6 does not divide over 8 data-parallel devices"),
    (["--mesh", "1x8", "--set", "model.mlp_dim=100"], "(e.g. --set rules.mlp=none to replicate it)"),
    (["--mesh", "fsdp=8", "--set", "model.d_model=60"], "(e.g. --set param_rules.embed=none to replicate it)"),
    (["--mesh", "8x1", "--data", "/nonexistent/corpus.txt"], "data path /nonexistent/corpus.txt does not exist"),
    (["--mesh", "8x1", "--set", "optimizer.lrr=1"], "unknown config key 'optimizer.lrr'"),
    (["--mesh", "8x1", "--config", "/nonexistent.toml"], "config file /nonexistent.toml not found"),
    (["--mesh", "8x1", "--config", "/dev/null"], "config file /dev/null is not a regular file"),
    (["--mesh", "8x1", "--set", "model.attention=cudnn"], "model.attention=cudnn can't run here: it needs an NVIDIA GPU"),
    (["--mesh", "cp", "--set", "model.attention=cudnn"], "model.attention=cudnn can't run here: context parallelism"),
    (["--set", "model=3"], "config key 'model' is a section"),
    (["--set", "model.name.x=1"], "config key model.name expects str, got {'x': 1}"),  # was a TypeError traceback
    (["--set", "init_from.x=1"], "config key 'init_from' is a value, not a section, so 'init_from.x' is not a key"),
    (["--seed", "-1"], "seed must be between 0 and 2**32-1, got -1"),
    (["--simulate-devices", "-1"], "--simulate-devices must be positive"),
    (["--run-dir", ""], "empty --run-dir"),
    (["--mesh", "data=100000"], "more than the 4096 CPU devices shard simulates"),
    (["--mesh", "8x1", "--simulate-devices", "100000"], "--simulate-devices 100000 asks for more than the 4096"),
    (["--mesh", "fsdp:abc:"], "mesh fsdp:abc::"),  # user text is not rich markup or :emoji: codes
    (["--mesh", "8x1", "--data", "/dev/zero"], "data path /dev/zero is not a regular file or folder"),
    (["--mesh", "8x1", "--eval-every", "1", "--set", "eval.processes=5"], "eval.processes is 5 but the job has 1"),
    (["--seq", "3000000000"], "data.seq_len must be positive and below 2**31, got 3000000000"),  # was a native abort
    (["--set", "model.d_model=99999999999999999999"], "model.d_model must be positive and below 2**31"),
    (["--allow-fresh"], "--allow-fresh goes with --resume"),  # it was ignored
    (["--failure-timeout", "1e12"], "cluster.failure_timeout must be positive and at most 1e6"),  # a traceback
    (["--steps", "1.5"], "Invalid value for '--steps'"),  # the CLI library's usage errors, one line too
    (["--bogus"], "No such option: --bogus (see "),
    (["--steps"], "Option '--steps' requires an argument"),
    (["--set", 'precision."layers/wqq"=fp8_rowwise'], "precision rule 'layers/wqq' decides no matmul weight of tiny"),
    (["--set", "precision.default=fp9"], "precision.default: unknown recipe 'fp9'"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = invoke("train", *TINY, *args)
    assert result.exit_code == 2, result.output
    said = [line for line in result.output.strip().splitlines() if not line.startswith("compiling the train step")]
    assert message in result.output and len(said) == 1, result.output  # (some are found while compiling)
    assert "Traceback" not in result.output


@pytest.mark.parametrize("name, content, flag, message", [
    ("bin.toml", b"\xff\xfe\x00binary", "--config", "is not a text (TOML) file"),
    ("bad.toml", b"[model\n", "--config", "config file {path} is not valid TOML"),
    ("folder.toml/", None, "--config", "config file {path} is a directory; give a TOML file"),
    ("models.toml", b'[[model]]\nname = "tiny"\n', "--config", "model must be a [model] table, got list"),
    ("neg.npy", None, "--data", "token id -3, outside 0..255"),
    ("afile", b"x", "--run-dir", "is a file; choose another --run-dir"),
    ("afile", b"x", "--init-from", "is a file; give a run dir"),
])
def test_bad_files_are_one_line_and_exit_2(tmp_path, name, content, flag, message):
    import numpy as np

    path = tmp_path / name
    if name.endswith("/"):
        path.mkdir()
    elif content is None:
        np.save(path, np.array([1, 2, -3, 4], np.int32))
    else:
        path.write_bytes(content)
    result = invoke("train", *TINY, "--mesh", "8x1", flag, str(path))
    assert result.exit_code == 2, result.output
    assert message.format(path=path) in result.output and len(result.output.strip().splitlines()) == 1


def test_a_run_dir_under_a_file_is_named_before_the_compile_cache(tmp_path):
    (tmp_path / "afile").write_text("x")
    result = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(tmp_path / "afile" / "sub"))
    assert result.exit_code == 2, result.output
    assert f"run dir {tmp_path / 'afile' / 'sub'} can't be made: {tmp_path / 'afile'} is a file" in result.output


def test_a_failed_first_start_leaves_nothing_and_the_resume_keeps_its_model(tmp_path):
    run = tmp_path / "r"
    failed = invoke("train", *TINY, "--mesh", "8x1", "--batch", "6", "--run-dir", str(run), "--compile-cache", "none")
    assert failed.exit_code == 2 and "does not divide" in failed.output
    assert not (run / "checkpoints").exists()  # so the corrected command is not refused
    ok = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(run), "--compile-cache", "none")
    assert ok.exit_code == 0, ok.output
    other = invoke("train", "--run-dir", str(run), "--resume", "--model", "small", "--steps", "3")
    assert other.exit_code == 2 and "continues the tiny run" in other.output
    assert 'name = "tiny"' in (run / "config.toml").read_text()


def test_out_of_memory_in_the_first_step_is_one_line_and_the_retry_runs(tmp_path, monkeypatch):
    import shard.training.loop

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 2321381353960 bytes.")

    run = tmp_path / "r"
    with monkeypatch.context() as m:
        m.setattr(shard.training.loop, "train", out_of_memory)
        failed = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(run), "--compile-cache", "none")
    assert failed.exit_code == 2, failed.output
    assert "error: out of memory (RESOURCE_EXHAUSTED: Out of memory allocating" in failed.output
    assert not run.exists()  # nothing logged or saved: the files it wrote, and the run dir it made, are gone
    fresh, own = tmp_path / "fresh", tmp_path / "own"  # a first start by --resume --allow-fresh, likewise
    own.mkdir()
    (own / "config.toml").write_text("steps = 3\n")
    with monkeypatch.context() as m:
        m.setattr(shard.training.loop, "train", out_of_memory)
        for where in (fresh, own):
            again = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(where), "--compile-cache", "none",
                           "--resume", "--allow-fresh")
            assert again.exit_code == 2 and "error: out of memory" in again.output, again.output
    assert not fresh.exists()
    assert [f.name for f in own.iterdir()] == ["config.toml"]  # the user's own file is not removed
    ok = invoke("train", *TINY, "--mesh", "8x1", "--batch", "16", "--run-dir", str(run), "--compile-cache", "none")
    assert ok.exit_code == 0, ok.output


def test_empty_data_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = invoke("train", *TINY, "--mesh", "8x1", "--data", str(empty))
    assert result.exit_code == 2 and "is empty" in result.output


def test_train_simulates_the_devices_the_mesh_needs(run_shard, tmp_path):
    r = run_shard("train", "--mesh", "4x4", *TINY, "--run-dir", "r", "--compile-cache", "cc", shared_cache=False)
    assert r.returncode == 0, r.stderr
    assert any((tmp_path / "cc").iterdir())  # the persistent compilation cache was written
    assert "simulating 16 CPU devices" in r.stderr
    assert "mesh data=4,model=4" in r.stdout
    assert "compiling the train step…" in r.stdout.split("mesh data=4,model=4")[0]  # said before it compiles
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[-1])
    assert record["step"] == 2 and {"loss", "tokens_per_s", "step_time_s"} <= set(record)
    assert 'name = "tiny"' in (tmp_path / "r" / "config.toml").read_text()
    # The run dir is never reused by accident.
    again = run_shard("train", "--mesh", "4x4", *TINY, "--run-dir", "r", "--compile-cache", "cc", shared_cache=False)
    assert again.returncode == 2 and "already holds a run" in again.stderr
    other = run_shard("train", "--mesh", "4x4", *TINY, "--steps", "3", "--run-dir", "r", shared_cache=False)
    assert other.returncode == 2 and "(steps is 2 there, 3 here); choose another --run-dir, or pass --resume to " \
        "continue that run with this change" in other.stderr


def test_a_compile_cache_that_is_a_file(run_shard, tmp_path):
    (tmp_path / "afile").write_text("x")
    r = run_shard("train", *TINY, "--run-dir", "r", "--compile-cache", "afile", shared_cache=False)
    assert r.returncode == 2 and "compile cache afile can't be used: it is a file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "r").exists()


def test_explicit_device_count_that_does_not_fit(run_shard):
    r = run_shard("train", "--mesh", "8x4", "--simulate-devices", "8", *TINY)
    assert r.returncode == 2
    assert "needs 32 devices but 8 exist" in r.stderr and "--simulate-devices 32" in r.stderr
    assert "Traceback" not in r.stderr


def test_inspect_13b_on_32_devices_from_shapes_alone(run_shard):
    r = run_shard("inspect", "--mesh", "8x4", "--model", "llama-13b", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["mesh"] == {"data": 8, "model": 4} and doc["devices"] == 32
    assert 12.5e9 < doc["param_count"] < 13.5e9
    rows = {row["name"]: row for row in doc["params"]}
    wq = rows["layers/wq"]
    assert wq["logical_axes"] == ["layers", "embed", "heads", "head_dim"]
    assert wq["partition_spec"] == [None, None, "model", None]
    assert wq["bytes_per_device"] * 4 == wq["bytes"]
    assert doc["params_bytes_per_device"] == sum(row["bytes_per_device"] for row in doc["params"])
    # AdamW keeps two fp32 moments per parameter, sharded like it (plus a few scalars).
    assert 0 <= doc["opt_state_bytes_per_device"] - 2 * doc["params_bytes_per_device"] < 1024


def test_help_shows_flags_as_flags_and_whole_phrases():
    """A flag took `<bool>` in typer's help, a docstring's line breaks broke eval's line mid-phrase, and
    rich took `[wandb]` in a help line for markup."""
    train_help = invoke("train", "--help").output
    (resume,) = [line for line in train_help.splitlines() if "--resume " in line]
    assert "<bool>" not in train_help and "continue the run" in resume
    assert "<int>" in train_help  # options that take a value still say what
    assert "(needs shard[wandb]; [tracking] sets" in train_help  # rich read the brackets as markup and ate them
    top = invoke("--help").output
    assert "data (as its evaluations saw it) or --data;" in top, top


def test_inspect_table(run_shard):
    """Piped (not a terminal), the table is whole: no cell cut to fit 80 columns; 13B reads in billions."""
    r = run_shard("inspect", "--mesh", "8x4", "--model", "llama-13b")
    assert r.returncode == 0, r.stderr
    rows = {cells[0]: cells[1:] for line in r.stdout.splitlines()
            if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) == 5}
    assert rows["layers/wq"] == ["40x5120x40x128", "layers, embed, heads, head_dim", "(None, None, model, None)",
                                 "1000.00 MiB"]
    assert rows["embed"] == ["32000x5120", "vocab, embed", "(model, None)", "156.25 MiB"]
    assert len(rows) == 12  # every parameter, one row each
    assert "13.02B parameters · per device: params 12.12 GiB, optimizer state 24.25 GiB" in r.stdout


def test_a_cluster_is_not_expected_after_its_command(monkeypatch):
    """`train` notes the cluster it will join, so that an error before joining still reaches the other
    processes; a later command in the same interpreter (a notebook, these tests) must not inherit it,
    or its first user error would try to join that cluster."""
    from shard.cluster import runtime
    from shard.run import start

    def bug(*args, **kwargs):
        raise RuntimeError("a bug, after the cluster was noted")

    monkeypatch.setattr(start.config_mod, "resolve", bug)
    result = invoke("train", "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1")
    assert isinstance(result.exception, RuntimeError)
    assert runtime._expected is None


def test_a_full_disk_and_out_of_memory_are_told_apart_with_advice_for_the_command():
    from shard.cli.app import user_error

    full = ValueError('RESOURCE_EXHAUSTED: Error writing "params.embed/0.0" in OCDBT database at local file '
                      '"/r/checkpoints/2.orbax-checkpoint-tmp/": Failed to write 841986 bytes to file 5: No space '
                      "left on device [os_error_code='28']")
    assert str(user_error(full)) == "/r/checkpoints/2.orbax-checkpoint-tmp/: No space left on device"
    # opening an array: the reason comes before kilobytes of JSON spec (in single quotes)
    spec = '{"context":{"cache_pool":{}},"kvstore":{"path":"/r/checkpoints/5.orbax-checkpoint-tmp/x/"}}'
    opening = ValueError('RESOURCE_EXHAUSTED: Error opening "zarr" driver: Error writing "count/.zarray" in OCDBT '
                         'database at local file "/r/checkpoints/5.orbax-checkpoint-tmp/x/": No space left on '
                         f"device [tensorstore_spec='{spec}'] [os_error_code='28']")
    assert str(user_error(opening)) == "/r/checkpoints/5.orbax-checkpoint-tmp/x/: No space left on device"
    located = ValueError("RESOURCE_EXHAUSTED: Failed writing: \"/r/c/2/d/ab\": No space left on device "
                         "[os_error_code='28'] [source locations='tensorstore/internal/os/file_util_posix.cc:380\n"
                         "tensorstore/kvstore/file/file_key_value_store.cc:362']")
    assert str(user_error(located)) == "/r/c/2/d/ab: No space left on device"
    quota = ValueError("UNKNOWN: Failed writing: \"/r/x\": Disk quota exceeded [os_error_code=122]\nAdditional: step 4")
    assert str(user_error(quota)) == "/r/x: Disk quota exceeded"
    oom = RuntimeError("INTERNAL: Out of memory allocating 38836157792 bytes.")
    assert str(user_error(oom, "generate")) == ("out of memory (INTERNAL: Out of memory allocating 38836157792 "
                                                "bytes.); give fewer or shorter prompts, or lower --max-new-tokens")
    assert str(user_error(oom, "bench")) == "out of memory (INTERNAL: Out of memory allocating 38836157792 bytes.)"
    assert "model.remat=full" in str(user_error(MemoryError(), "train"))


def test_orbax_noise_are_dropped_from_the_log():
    import logging

    from shard.run.orbax_quiet import _orbax_noise

    def record(path, exc_info):
        return logging.LogRecord("absl", logging.ERROR, path, 1, "save failed", None, exc_info)

    failed = (ValueError, ValueError("x"), None)
    assert not _orbax_noise(record("/site-packages/orbax/checkpoint/_src/x.py", failed))
    assert _orbax_noise(record("/site-packages/orbax/checkpoint/_src/x.py", None))  # a message alone
    assert _orbax_noise(record("/site-packages/jax/x.py", failed))

    def task(coro_file):  # asyncio's report of a task collected with its exception unread
        msg = (f"Task exception was never retrieved\nfuture: <Task finished coro=<write() defined at {coro_file}:126> "
               "exception=ValueError('No space left on device')>")
        return logging.LogRecord("asyncio", logging.ERROR, "/lib/asyncio/base_events.py", 1, msg, None, failed)

    assert not _orbax_noise(task("/site-packages/orbax/checkpoint/_src/serialization/serialization.py"))
    assert _orbax_noise(task("/work/mine.py"))

    def note(message):  # what orbax logs on reading a damaged checkpoint, before shard's one-line error
        return logging.LogRecord("absl", logging.WARNING, "/site-packages/orbax/checkpoint/_src/m.py", 1, message,
                                 None, None)

    assert not _orbax_noise(note('Item "state" was found in the checkpoint, but could not be restored.'))
    assert not _orbax_noise(note("Failed to json parse Metadata file: /r/checkpoints/2/_CHECKPOINT_METADATA"))
    assert _orbax_noise(note("Saving checkpoint at step 2"))


def test_a_failed_array_read_is_named_by_the_error_orbax_wrapped():
    from shard.run.read_failures import error_line as _first_line

    try:
        try:
            raise ValueError('OUT_OF_RANGE: Error reading "params.embed/0.0" in OCDBT database')
        except ValueError as cause:
            raise Exception("Encountered error while reading array index: (slice(0, 2, 1),). See full TensorStore "
                            "details: <bound method pybind11_detail_function_record.spec of TensorStore({\n") from cause
    except Exception as e:  # noqa: BLE001
        assert _first_line(e) == 'ValueError: OUT_OF_RANGE: Error reading "params.embed/0.0" in OCDBT database'


def test_usage_errors_of_click_itself_are_one_line_too():
    """Older typer raises click's own UsageError: recognised by name, like typer's bundled copy."""
    from shard.cli.app import _usage_error

    class UsageError(Exception):
        exit_code = 2
        ctx = None

        def format_message(self):
            return "No such option: --x"

    assert str(_usage_error(UsageError())) == "No such option: --x"
    assert _usage_error(ValueError("x")) is None


def test_a_resume_that_changes_the_windows_or_the_schedule_says_so(tmp_path):
    run = tmp_path / "r"
    first = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(run), "--compile-cache", "none")
    assert first.exit_code == 0, first.output
    # the default warmup (10 steps) in a run of 2: cut, and said
    assert "optimizer.warmup_steps 10 is not below --steps 2: the warmup is cut to 1 step," in first.output
    resumed = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(run), "--resume", "--steps", "3",
                     "--eval-every", "1", "--compile-cache", "none")  # TINY's 2 steps, and one more
    assert resumed.exit_code == 0, resumed.output
    assert "now holds out the last 5% of the data" in resumed.output and "not an exact resume" in resumed.output
    # more steps stretch the cosine (and here the warmup): the learning rate after the resume moves
    assert "the learning-rate schedule changes (steps 2 -> 3)" in resumed.output
    again = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(run), "--resume", "--steps", "4",
                   "--set", "optimizer.lr=1e-3", "--compile-cache", "none")
    assert again.exit_code == 0, again.output
    assert "(optimizer.lr 0.002 -> 0.001, steps 3 -> 4)" in again.output and "holds out" not in again.output
    assert "the model changes" not in again.output and "the optimizer changes" not in again.output
    assert "done: 1 step (4, resumed)" in again.output
    # the seed and the batch: neither resume is exact; tokens seen count each batch at its own size
    other = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(run), "--resume", "--steps", "5",
                   "--set", "optimizer.lr=1e-3", "--batch", "16", "--seed", "3", "--compile-cache", "none",
                   "--set", "model.rope_theta=1e6", "--set", "optimizer.b2=0.5")
    assert other.exit_code == 0, other.output
    assert "the data order changes (seed 0 -> 3)" in other.output
    assert "the batch changes (data.batch 8 -> 16)" in other.output
    assert "the model changes (model.rope_theta 10000.0 -> 1000000.0)" in other.output
    assert "the optimizer changes (optimizer.b2 0.95 -> 0.5)" in other.output
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 5 and last["tokens_seen"] == (4 * 8 + 16) * 32
    # and each at its own sequence length: the count is saved with the checkpoint, not rebuilt from the
    # data position at the new length (which made it (4 * 8 + 16) * 16 + 16 * 16)
    shorter = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(run), "--resume", "--steps", "6",
                     "--set", "optimizer.lr=1e-3", "--batch", "16", "--seed", "3", "--seq", "16",
                     "--set", "model.rope_theta=1e6", "--set", "optimizer.b2=0.5", "--compile-cache", "none")
    assert shorter.exit_code == 0, shorter.output
    assert "data.seq_len 32 -> 16" in shorter.output
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 6 and last["tokens_seen"] == (4 * 8 + 16) * 32 + 16 * 16
    # a run saved before eval.holdout existed (its config has no such key) trained on every window
    old = tmp_path / "old"
    first = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(old), "--eval-every", "1", "--compile-cache",
                   "none")
    assert first.exit_code == 0, first.output
    saved = (old / "config.toml").read_text()
    assert "holdout = 0.05\n" in saved
    (old / "config.toml").write_text(saved.replace("holdout = 0.05\n", ""))
    resumed = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(old), "--resume", "--steps", "3",
                     "--compile-cache", "none")
    assert resumed.exit_code == 0 and "now holds out the last 5% of the data" in resumed.output, resumed.output


def test_a_run_dir_holding_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for more in ([], ["--resume", "--allow-fresh"]):
        result = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(tmp_path), *more)
        assert result.exit_code == 2 and "holds files that are not a shard run (e.g. notes.txt)" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    # a user's own hf/ (a downloaded model) is not a run's: refused, never removed by a failed start
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    result = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(tmp_path))
    assert result.exit_code == 2 and "not a shard run (e.g. hf)" in result.output, result.output
    assert (tmp_path / "hf" / "config.json").is_file()


def test_a_run_whose_start_crashed_names_the_way_to_start_it_again(tmp_path):
    """What a start that died natively (no cleanup) leaves: its config and empty files. The cluster keys
    it was started with don't make it another config."""
    from shard import config as config_mod

    first = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(tmp_path / "r"), "--compile-cache", "none",
                   "--set", "cluster.failure_timeout=30")
    assert first.exit_code == 0, first.output
    (tmp_path / "r" / "metrics.jsonl").write_text("")
    shutil.rmtree(tmp_path / "r" / "checkpoints")
    saved = config_mod.load_file(str(tmp_path / "r" / "config.toml"))
    assert saved["cluster"]["failure_timeout"] == 30
    again = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(tmp_path / "r"), "--compile-cache", "none")
    assert again.exit_code == 2 and "never logged a step or saved a checkpoint" in again.output, again.output
    assert "--resume --allow-fresh" in again.output


def test_a_diverged_run_ends_in_one_line_and_keeps_that_steps_record(tmp_path):
    """Through the console too: the record of the diverged step has the usual fields (it once lacked
    tokens_per_s, and the progress display raised KeyError over the divergence)."""
    run = tmp_path / "r"
    result = invoke("train", *TINY, "--steps", "20", "--mesh", "8x1", "--run-dir", str(run), "--compile-cache", "none",
                    "--set", "optimizer.lr=1e6", "--set", "optimizer.warmup_steps=0")
    assert result.exit_code == 2 and "error: training diverged:" in result.output, result.output
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert "diverged" in last and last["tokens_per_s"] > 0 and f"at step {last['step']}" in last["diverged"]


def test_hidden_leftovers_do_not_make_a_run_dir_foreign_and_a_missing_eval_path_is_named(tmp_path):
    (tmp_path / ".DS_Store").write_text("")
    (tmp_path / ".shard-shared-abc").write_text("")  # a marker left by a process 0 that died at start
    missing = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(tmp_path), "--eval-every", "1",
                     "--set", f"eval.path={tmp_path / 'nope.txt'}")
    assert missing.exit_code == 2 and f"eval.path {tmp_path / 'nope.txt'} does not exist" in missing.output
    ok = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(tmp_path), "--compile-cache", "none")
    assert ok.exit_code == 0, ok.output


def test_an_empty_eval_path_is_refused_before_the_step_compiles_and_leaves_no_run(tmp_path):
    """It was read at the first evaluation, after step 1 was logged and saved: a run left to --resume."""
    (tmp_path / "empty.txt").write_text("")
    run = tmp_path / "run"
    r = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(run), "--eval-every", "1",
               "--set", f"eval.path={tmp_path / 'empty.txt'}", "--compile-cache", "none")
    assert r.exit_code == 2 and f"eval.path: data path {tmp_path / 'empty.txt'} is empty" in r.output, r.output
    assert "compiled" not in r.output and not run.exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no folder can be made")
def test_a_run_dir_that_cant_be_written_is_named_before_devices_start(tmp_path):
    r = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", "/proc/shard-test-run")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "run dir /proc/shard-test-run can't be written (No such file or directory); choose another --run-dir" \
        in r.output


def test_flag_values_reach_the_config_as_given_and_a_mesh_file_names_one_folder():
    """Flags went through JSON text into TOML: `--run-dir runs/😀` became a quoted, escaped string. A mesh
    given as a TOML path made the default run dir several nested folders."""
    from shard.cli.options import overrides as _overrides
    from shard.run.run_dir import mesh_label

    assert _overrides({}, None, run_dir="runs/😀", batch=8) == {"run_dir": "runs/😀", "data": {"batch": 8}}
    assert mesh_label("/tmp/my meshes/wide.toml") == "wide"
    assert mesh_label("data=2,fsdp=4") == "data2_fsdp4" and mesh_label("fsdp_tp:4x2") == "fsdp_tp_4x2"


def test_a_model_flag_over_a_config_file_that_amends_another_model_is_refused():
    """`--config RUN/config.toml --model small` trained a model labelled small with the file's tiny
    dimensions (its [model] lists every key, and they amended small)."""
    import dataclasses

    from shard.cli.options import overrides as _overrides
    from shard.errors import ShardError

    run_config = {"model": dataclasses.asdict(config.resolve({"model": {"name": "tiny"}}).model)}
    with pytest.raises(ShardError, match="describes model tiny whole .*leave out --model"):
        _overrides(run_config, None, model="small")
    with pytest.raises(ShardError, match="describes model tiny whole"):
        _overrides(run_config, ["model.name=small"])
    assert _overrides(run_config, None, model="tiny")["model"]["d_model"] == 64
    assert _overrides({"model": {"name": "tiny"}}, None, model="small") == {"model": {"name": "small"}}
    # a recipe's partial [model] amends the model named
    recipe = _overrides({"model": {"name": "tiny", "remat": "full"}}, None, model="small")["model"]
    assert recipe == {"name": "small", "remat": "full"}


def test_a_mesh_file_that_is_not_a_regular_file_is_refused(tmp_path):
    """A FIFO named as the mesh hung `train` and `inspect` on its read."""
    import os

    fifo = tmp_path / "mesh.toml"
    os.mkfifo(fifo)
    for command in (["train", *TINY, "--run-dir", str(tmp_path / "r")], ["inspect"]):
        r = invoke(*command, "--mesh", str(fifo))
        assert r.exit_code == 2 and f"mesh preset file {fifo} is not a regular file" in r.output, r.output


def test_the_continue_hint_names_the_launcher():
    """After a stop signal a multi-process job was told to continue with a one-process command."""
    from pathlib import Path

    from shard.run.run_dir import continue_command
    from shard.cluster.launch import ClusterSpec

    run = Path("runs/a")
    assert continue_command(run, None) == "shard train --run-dir runs/a --resume"
    assert continue_command(Path("my runs/a"), None) == "shard train --run-dir 'my runs/a' --resume"
    assert continue_command(run, ClusterSpec("mpi", 2, 0)) == "mpiexec -n 2 shard train --run-dir runs/a --resume"
    assert continue_command(run, ClusterSpec("slurm", 4, 1)).startswith("srun shard train --run-dir runs/a --resume")
    assert continue_command(run, ClusterSpec("explicit", 2, 1, "h0:7777")) == (
        "shard train --run-dir runs/a --resume --coordinator h0:7777 --num-processes 2 --process-id I, on each "
        "process I")


@pytest.mark.parametrize("found", [set(), {"config.toml", "hf"}, {"tb"}])
def test_a_failed_start_removes_what_it_wrote_and_keeps_what_was_there(tmp_path, found):
    """A --resume --allow-fresh base (config.toml and the Hugging Face side files beside it) stays, and so
    does a user's own tb/ in a folder given as a new run dir: a failed first start removed that whole."""
    from shard.run.run_dir import forget_unstarted_run

    for name in ("config.toml", "metrics.jsonl"):
        (tmp_path / name).write_text("")
    for name in ("tb", "hf"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "theirs").write_text("x")
    forget_unstarted_run(tmp_path, found)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(found)
    assert all((tmp_path / name / "theirs").exists() for name in found & {"tb", "hf"})


def test_an_atomic_write_that_fails_leaves_the_old_text(tmp_path):
    from shard.paths import write_text_atomic

    target = tmp_path / "config.toml"
    write_text_atomic(target, "steps = 1\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(target, "steps = 2\n\ud800")  # fails mid-write, as a full disk would
    assert target.read_text() == "steps = 1\n" and [p.name for p in tmp_path.iterdir()] == ["config.toml"]


def test_a_resume_takes_the_checkpoints_config_when_config_toml_is_empty(tmp_path):
    """A config.toml emptied by a full disk resumed with every default (lr 0.002, log_every 10), or failed
    with a misleading shape error."""
    run = tmp_path / "r"
    first = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(run), "--set", "optimizer.lr=5e-4",
                   "--compile-cache", "none")
    assert first.exit_code == 0, first.output
    (run / "config.toml").write_text("")
    again = invoke("train", "--run-dir", str(run), "--resume", "--steps", "3", "--compile-cache", "none")
    assert again.exit_code == 0, again.output
    assert f"{run / 'config.toml'} is empty: using the config saved with checkpoint 2" in again.output
    assert "optimizer.lr" not in again.output  # no schedule change: the saved lr was taken
    saved = config.resolve(config.load_file(str(run / "config.toml")))
    assert (saved.optimizer.lr, saved.model.name, saved.steps) == (5e-4, "tiny", 3)
    # one that does not parse may hold the user's edit: not read over, and the way out is named
    (run / "config.toml").write_text("steps = [\n")
    broken = invoke("train", "--run-dir", str(run), "--resume", "--steps", "4", "--compile-cache", "none")
    assert broken.exit_code == 2 and "move it away to resume with the config saved with checkpoint 3" in broken.output
    assert (run / "config.toml").read_text() == "steps = [\n"


def test_an_error_with_an_empty_message_is_named_by_its_type():
    """The join and the barrier took `str(e).splitlines()[0]`: an IndexError hid the error itself."""
    from shard.errors import first_line

    assert first_line(RuntimeError()) == "RuntimeError" and first_line(ValueError("\n a\nb")) == "a"


def test_the_stop_handlers_still_take_signals_while_the_final_save_is_awaited(tmp_path, monkeypatch):
    """The stopper's handlers were removed before the saver waited for the last save, so a SIGTERM
    there killed the process and lost the save."""
    import signal

    from shard.run.checkpoint import SaveCheckpoints

    seen = []
    wait = SaveCheckpoints.on_end
    monkeypatch.setattr(SaveCheckpoints, "on_end",
                        lambda self, records: (seen.append(signal.getsignal(signal.SIGTERM)), wait(self, records)))
    r = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(tmp_path / "r"), "--compile-cache", "none")
    assert r.exit_code == 0, r.output
    assert len(seen) == 1 and getattr(seen[0], "__self__", None).__class__.__name__ == "StopOnSignal"


def test_a_relative_data_path_is_saved_absolute(tmp_path, monkeypatch):
    """A resume started from another folder read that folder's file of the same name, with no notice
    (or, for a mesh file, failed: not found)."""
    import numpy as np

    for folder, seed in (("a", 0), ("b", 1)):
        (tmp_path / folder).mkdir()
        np.save(tmp_path / folder / "tokens.npy", np.random.default_rng(seed).integers(0, 256, 5000, np.int32))
    monkeypatch.chdir(tmp_path / "a")
    (tmp_path / "a" / "mesh.toml").write_text('axes = ["data", "model"]\n')  # a mesh file: saved absolute too
    first = invoke("train", *TINY, "--mesh", "mesh.toml:8x1", "--data", "tokens.npy", "--run-dir",
                   str(tmp_path / "r"), "--compile-cache", "none", "--set", "eval.path=tokens.npy")
    assert first.exit_code == 0, first.output
    assert "step 2/2 · loss " in first.output  # not a terminal: a line per logged step, not a bar at the end
    # with the memory (on a CPU, XLA's estimate), the time run and left (no MFU: no CPU peak is known)
    assert re.search(r"step 2/2 · loss [\d.]+ · [\d,]+ tokens/s · mem ~[\d.]+[BKMG] · \d+:\d\d:\d\d elapsed, "
                     r"ETA 0:00:00\n", first.output), first.output
    saved = config.resolve(config.load_file(str(tmp_path / "r" / "config.toml")))
    # eval.path too, though unused until a resume sets --eval-every
    assert saved.data.path == saved.eval.path == str(tmp_path / "a" / "tokens.npy")
    assert saved.mesh.spec == f"{tmp_path / 'a' / 'mesh.toml'}:8x1"
    # a run saved before data paths were saved absolute, resumed from its own folder: the same files
    toml = (tmp_path / "r" / "config.toml").read_text().replace(f'"{tmp_path / "a" / "tokens.npy"}"', '"tokens.npy"')
    assert 'path = "tokens.npy"' in toml
    (tmp_path / "r" / "config.toml").write_text(toml)
    same = invoke("train", "--run-dir", str(tmp_path / "r"), "--resume", "--steps", "3", "--compile-cache", "none")
    assert same.exit_code == 0 and "data order changes" not in same.output, same.output
    monkeypatch.chdir(tmp_path / "b")
    again = invoke("train", "--run-dir", str(tmp_path / "r"), "--resume", "--steps", "4", "--compile-cache", "none")
    assert again.exit_code == 0 and "resumed from step 3" in again.output, again.output
    assert "data order changes" not in again.output
    moved = invoke("train", "--run-dir", str(tmp_path / "r"), "--resume", "--steps", "5", "--data", "tokens.npy",
                   "--compile-cache", "none")  # this folder's file, named as such
    assert f"data.path {tmp_path / 'a' / 'tokens.npy'} -> {tmp_path / 'b' / 'tokens.npy'}" in moved.output


def test_resume_takes_the_run_dir_from_the_config_file(tmp_path):
    run = tmp_path / "r"
    first = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(run), "--compile-cache", "none")
    assert first.exit_code == 0, first.output
    again = invoke("train", "--config", str(run / "config.toml"), "--resume", "--steps", "3", "--compile-cache", "none")
    assert again.exit_code == 0 and "resumed from step 2" in again.output, again.output



def test_a_blank_run_dir_in_the_config_file_of_a_resume_is_refused(tmp_path):
    """--resume reads the run dir from the --config file when --run-dir is not given: a blank one there is
    the same error as a blank flag."""
    config_file = tmp_path / "c.toml"
    config_file.write_text('run_dir = "  "\n')
    result = invoke("train", *TINY, "--config", str(config_file), "--resume", "--allow-fresh")
    assert result.exit_code == 2 and "empty --run-dir" in result.output, result.output

def test_the_embedded_corpus_resumed_on_the_current_folder_is_a_data_change(tmp_path, monkeypatch):
    """An old run's relative data.path read from its own folder is the same files; the embedded corpus
    (data.path "") is not the current folder, though Path("").absolute() is."""
    import dataclasses

    from shard.run.resume import resume_changes

    monkeypatch.chdir(tmp_path)
    cfg = config.resolve({"model": {"name": "tiny"}})
    here = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(tmp_path)))
    assert any("the data order changes" in n for n in resume_changes({"model": {"name": "tiny"}}, here))
    assert not resume_changes({"model": {"name": "tiny"}, "data": {"path": "."}}, here)


def test_eval_scores_a_checkpoint_on_the_held_out_data_its_run_evaluated_on(tmp_path):
    """`shard eval RUN` reproduces the run's last logged eval loss (the same held-out batches, here on
    another mesh); --data scores other text; a run that held nothing out is refused, not scored on data
    it trained on."""
    run = tmp_path / "r"
    trained = invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(run), "--eval-every", "2",
                     "--compile-cache", "none")
    assert trained.exit_code == 0, trained.output
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]["eval_loss"]
    scored = invoke("eval", str(run), "--mesh", "4x2", "--json")
    assert scored.exit_code == 0, scored.output
    figures = json.loads(scored.output.strip().splitlines()[-1])
    assert figures["eval_loss"] == pytest.approx(logged, rel=1e-5) and figures["tokens"] == 2 * 8 * 32
    text = tmp_path / "other.txt"
    text.write_text("an unrelated text, " * 20)
    other = invoke("eval", str(run), "--data", str(text), "--batches", "50", "--mesh", "8x1")
    assert other.exit_code == 0 and f"of --data {text}" in other.output, other.output
    assert re.search(r"the data holds \d+ window\(s\) of 33 tokens: scoring 1 batch\(es\) of 8", other.output)  # none twice
    plain = tmp_path / "plain"
    assert invoke("train", *TINY, "--mesh", "8x1", "--run-dir", str(plain), "--compile-cache", "none").exit_code == 0
    refused = invoke("eval", str(plain), "--mesh", "8x1")
    assert refused.exit_code == 2 and "trained on all of its data" in refused.output, refused.output
    # evaluations started by a resume: the 2 steps before it read all the data, which eval says (it
    # claimed "held out from training"), and so it goes on saying after the next resume
    for steps, extra in (("3", ["--eval-every", "1"]), ("4", [])):
        resumed = invoke("train", "--run-dir", str(plain), "--resume", "--steps", steps, *extra, "--compile-cache", "none")
        assert resumed.exit_code == 0, resumed.output
        late = invoke("eval", str(plain), "--mesh", "8x1")
        assert late.exit_code == 0 and "held out from training only since step 2" in late.output, late.output
    assert "held out from training\n" in invoke("eval", str(run), "--mesh", "8x1").output
    assert "global batch 3 does not divide over 4 data-parallel devices" in \
        invoke("eval", str(run), "--mesh", "4x2", "--batch", "3").output
    assert "sequence length 33 does not divide over 4 devices" in invoke("eval", str(run), "--mesh", "cp", "--seq", "33").output
    few = invoke("eval", str(run), "--data", str(text), "--batch", "16", "--mesh", "8x1")
    assert few.exit_code == 2 and "fewer than one batch of 16" in few.output, few.output
    assert "--batches must be positive" in invoke("eval", str(run), "--batches", "0", "--mesh", "8x1").output


def test_a_second_ctrl_c_says_what_it_left(tmp_path, monkeypatch):
    """The second SIGINT raises KeyboardInterrupt out of the loop (tests/test_step.py): the process
    ended with exit 130 and no word on the save it skipped."""
    from shard.training.preemption import StopOnSignal

    def second_ctrl_c(self):
        if self.calls == 2:
            raise KeyboardInterrupt
        self.calls += 1
        return False

    monkeypatch.setattr(StopOnSignal, "calls", 0, raising=False)
    monkeypatch.setattr(StopOnSignal, "should_stop", second_ctrl_c)
    r = invoke("train", *TINY, "--steps", "5", "--mesh", "8x1", "--run-dir", str(tmp_path / "r"), "--checkpoint-every",
               "1", "--compile-cache", "none")
    assert r.exit_code == 130, r.output
    assert f"the newest complete checkpoint is {tmp_path / 'r' / 'checkpoints' / '2'}" in r.output, r.output
    # without a first signal (before the loop takes them, as here) it is not "again"
    assert "interrupted: stopped at once" in r.output, r.output


def test_inspect_draws_the_pipeline_schedule():
    """A mesh with stages: inspect prints the schedule's table as a chart, its bubble beside the formula's."""
    r = invoke("inspect", "--mesh", "stage=4,data=2", "--model", "tiny", "--set", "model.n_layers=4",
               "--set", "pipeline.microbatches=8")
    assert r.exit_code == 0, r.output
    assert "pipeline 1f1b: 4 stages x 8 microbatches, 22 ticks, bubble 0.273 (formula 0.273)" in r.output
    assert "stage 0 FFFF...BFBFBFBFB.B.B.B\nstage 1 .FFF..BFBFBFBFBFB.B.B." in r.output
