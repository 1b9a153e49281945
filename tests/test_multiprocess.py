"""Several real processes on one machine: explicit coordinator (gloo), mpiexec auto-detection, the MPI
bridge, process sets, and a lost process. Each run is the tiny model for 3 steps; ports are chosen free."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from shard.training.loop import train
from shard.observe.metrics import read_jsonl
from shard.testing import (AGREEMENT_ARGS, agreement_config, assert_same_curves, devices_for, finish, free_ports,
                           subprocess_env, tiny_config, train_curves, xla_flags_for_tests)

BIN = Path(sys.executable).parent
MPIEXEC = shutil.which("mpiexec", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
TINY = ["--model", "tiny", "--steps", "3", "--batch", "8", "--seq", "32", "--log-every", "1"]
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: ./install.sh mpi")


def child_env() -> dict:
    env = subprocess_env()  # each process simulates what the CLI asks for
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def shard_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "shard", "train", *args]


def explicit(n: int, args, cwd, port: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(shard_cmd(*args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
                                       "--process-id", str(i)),
                             cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(n)]


def run_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")]


def run_curves(run_dir: Path) -> dict[str, list[float]]:
    records = read_jsonl(run_dir / "metrics.jsonl")
    return {key: [r[key] for r in records] for key in ("loss", "grad_norm")}


@pytest.fixture(scope="module")
def agreed():
    """Loss and grad_norm at every step of one process on 8 devices, 4 steps without warm-up
    (shard.testing.agreement_config): what the plain multi-process runs must match."""
    return train_curves(agreement_config("2x4"))


@pytest.fixture(scope="module")
def reference():
    """Losses of one process on 8 devices, the numbers every multi-process run must match (layouts
    agree to rtol 1e-5 over 3 steps, so this serves the 2x1 runs too); and, with evaluation (which holds
    out the tail of the data, so training reads other windows), the losses and held-out losses."""
    plain = train(tiny_config("2x4"), devices=devices_for("2x4"))
    evaluated = train(tiny_config("2x4", eval__every=1), devices=devices_for("2x4"))
    return ([r["loss"] for r in plain], [r["loss"] for r in evaluated], [r["eval_loss"] for r in evaluated],
            [r["grad_norm"] for r in plain], [r["grad_norm"] for r in evaluated])


# The words of gloo's connection banner, which the C++ library prints in every process from one thread
# per local device: interleaved, a banner can break into lines of its fragments.
GLOO_BANNER = re.compile(r"\[Gloo\] Rank|is connected to|peer ranks\.|"
                         r"Expected number of connected peer ranks is :|\d+|\s+")


def own_lines(text: str) -> list[str]:
    """Output lines, less gloo's connection banners and their fragments."""
    return [line for line in text.splitlines() if GLOO_BANNER.sub("", line)]


def _two(tmp_path, args0, args1, cwd1=None):
    """Processes 0 and 1 of one job, each with its own arguments (and process 1's working directory)."""
    port = free_ports()[0]
    procs = [subprocess.Popen(shard_cmd(*args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                        "--process-id", str(i)),
                              cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, (args, cwd) in enumerate([(args0, tmp_path), (args1, cwd1 or tmp_path)])]
    return finish(procs)


def test_processes_started_with_different_configs_stop_at_once_naming_the_key(tmp_path):
    """Before, a different --batch trained silently on mismatched batches; a different --steps hung."""
    base = [*TINY, "--mesh", "2x4", "--run-dir", "r"]
    (rc0, _, err0), (rc1, _, err1) = _two(tmp_path, base, [*base, "--batch", "16"])
    assert rc0 == 2 and rc1 == 2, err0[-2000:] + err1[-2000:]
    assert "process 1 was started with a different config from process 0's: data.batch is 8 on process 0, 16 " \
           "here" in err1
    assert "another process of this job was started with a different config" in err0
    assert not (tmp_path / "r").exists()
    # a mesh that gives the processes different device counts: named too (it failed a collective that
    # assumed equal counts, "cannot reshape array of size 12", exit 3 as if a restart could mend it)
    (rc0, _, err0), (rc1, _, err1) = _two(tmp_path, [*TINY, "--mesh", "8", "--run-dir", "r"],
                                          [*TINY, "--mesh", "16", "--run-dir", "r"])
    assert rc0 == 2 and rc1 == 2, err0[-2000:] + err1[-2000:]
    assert "mesh.spec is '8' on process 0, '16' here" in err1


def test_resume_on_one_process_only_is_refused(tmp_path):
    """--resume (or --init-from) is not in the config: process 0 restored while process 1 initialised,
    and both waited in a collective for ever, deaf to SIGTERM."""
    base = [*TINY, "--mesh", "2x4", "--run-dir", "r"]
    (rc0, _, err0), (rc1, _, err1) = _two(tmp_path, [*base, "--resume", "--allow-fresh"], base)
    assert rc0 == 2 and rc1 == 2, err0[-2000:] + err1[-2000:]
    assert "process 1 was started with no --resume, process 0 with --resume; start every process with the " \
           "same command" in err1
    assert "another process of this job was started with a different config (or --resume" in err0


def test_a_different_num_processes_is_named(tmp_path):
    """Process 1 told --num-processes 4 joined process 0's job of 2 with half its devices: a raw
    traceback from orbax ("cannot reshape array of size 6 into shape (2,4)") on both."""
    port = free_ports()[0]
    procs = [subprocess.Popen(shard_cmd(*TINY, "--mesh", "2x4", "--run-dir", "r", "--coordinator",
                                        f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)),
                              cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, n in enumerate((2, 4))]
    (rc0, _, err0), (rc1, _, err1) = finish(procs)
    assert rc0 == 2 and rc1 == 2, err0[-2000:] + err1[-2000:]
    assert "process 1 was started for a job of 4 processes, but joined one of 2; start every process with the " \
           "same --num-processes" in err1 and "process 1 stopped on: process 1 was started for a job of 4" in err0
    assert "Traceback" not in err0 + err1


def test_a_run_dir_that_is_not_one_shared_folder_is_refused(tmp_path):
    """A relative --run-dir from two working directories (or a local disk per host): the first save
    never completed and both processes waited for ever."""
    (tmp_path / "elsewhere").mkdir()
    args = [*TINY, "--mesh", "2x4", "--run-dir", "r"]
    (rc0, _, err0), (rc1, _, err1) = _two(tmp_path, args, args, cwd1=tmp_path / "elsewhere")
    assert rc0 == 2 and rc1 == 2, err0[-2000:] + err1[-2000:]
    assert "run dir r is not one folder shared by every process (this process does not see it)" in err1
    assert "(another process does not see it)" in err0
    assert not list(tmp_path.rglob(".shard-shared-*"))  # the marker is gone


@pytest.mark.parametrize("key", ["data.path", "eval.path"])
def test_processes_that_find_other_data_at_the_data_path_stop_at_once(tmp_path, key):
    """Each host's own data.txt: process 1 trained its rows of every batch on other text, in silence."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "data.txt").write_text("the same words on every host, or so one hopes " * 40)
    (tmp_path / "elsewhere" / "data.txt").write_text("other words entirely, on the second host " * 40)
    args = [*TINY, "--mesh", "2x4", "--run-dir", str(tmp_path / "r")]
    args += ["--data", "data.txt"] if key == "data.path" else ["--eval-every", "1", "--set", "eval.path=data.txt"]
    (rc0, _, err0), (rc1, _, err1) = _two(tmp_path, args, args, cwd1=tmp_path / "elsewhere")
    assert rc0 == 2 and rc1 == 2, err0[-2000:] + err1[-2000:]
    assert re.search(rf"{key} \S+/elsewhere/data.txt holds other data here than on process 0 \(name, bytes, CRC: "
                     r"'data.txt 1840 \w+' there, 'data.txt 1640 \w+' here\)", err1), err1[-2000:]
    assert "holds other data on another process of this job than on process 0" in err0
    assert not (tmp_path / "r").exists()


def test_two_processes_match_one(tmp_path, agreed):
    procs = explicit(2, [*TINY, *AGREEMENT_ARGS, "--mesh", "2x4", "--run-dir", "r"], tmp_path, free_ports()[0])
    (rc0, out0, err0), (rc1, out1, err1) = finish(procs)
    assert rc0 == 0 and rc1 == 0, err0[-2000:] + err1[-2000:]
    assert "mesh data=2,model=4 on 8 cpu device(s) in 2 processes" in out0
    assert "simulating 4 CPU devices in each of 2 processes" in err0
    assert own_lines(out1) == [] and "simulating" not in err1  # only process 0 prints
    assert "Gloo" not in out0 + err0 + err1  # gloo's connection banner is dropped
    assert_same_curves(run_curves(tmp_path / "r"), agreed)


def test_a_checkpoint_one_process_cannot_read_is_set_aside_and_every_process_falls_back(tmp_path, reference):
    """A damaged file that only process 1 reads: process 1's read failed while process 0 waited in
    orbax's closing barrier; process 0 took the barrier mismatch for its own unreadable checkpoint, and
    both stopped with exit 3 (a collective failed). They now agree on the outcome and fall back."""
    args = [*TINY, "--mesh", "fsdp=8", "--run-dir", "r", "--checkpoint-every", "2"]  # each process writes its half
    (rc0, _, err0), (rc1, _, err1) = finish(explicit(2, args, tmp_path, free_ports()[0]))
    assert rc0 == 0 and rc1 == 0, err0[-2000:] + err1[-2000:]
    run = tmp_path / "r"
    largest = max((run / "checkpoints" / "3" / "state" / "ocdbt.process_1" / "d").iterdir(),
                  key=lambda f: f.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:100])
    (run / "metrics.jsonl").write_text("".join((run / "metrics.jsonl").read_text().splitlines(True)[:2]))
    (rc0, _, err0), (rc1, _, err1) = finish(explicit(2, [*args, "--resume"], tmp_path, free_ports()[0]))
    assert rc0 == 0 and rc1 == 0, err0[-2000:] + err1[-2000:]
    assert re.search(r"checkpoint \S+/3 is unreadable on process 1 \(.+\); set aside as corrupt-3, falling back to "
                     r"step 2", err0), err0[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "3", "corrupt-3"]
    np.testing.assert_allclose(run_losses(run), reference[0], rtol=1e-5)


def test_a_snapshot_two_processes_wrote_resumes_on_one(tmp_path):
    """The elastic case in small: two processes (fsdp=8, each writing its half of every array) take local
    snapshots into one /dev/shm folder; process 0 is killed (-9) while the snapshot of step 6 is
    committed, process 1 with it; one process on 4 devices resumes from the snapshot of step 4 and
    finishes within float tolerance of the uninterrupted run, leaving no snapshot behind."""
    from shard.run.snapshots import snapshot_folder

    folder = snapshot_folder("auto", tmp_path / "r")
    args = [*TINY, "--steps", "8", "--mesh", "fsdp=8", "--run-dir", "r", "--checkpoint-every", "1000",
            "--set", "checkpoint.local_every=2"]
    port, killer = free_ports()[0], Path(__file__).parent / "helpers" / "killed_in_save.py"
    env = child_env() | {"SHARD_TEST_KILL_AT": f"{re.escape(str(folder))}/6$"}
    procs = [subprocess.Popen([sys.executable, str(killer), "train", *args, "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        procs[0].wait(timeout=300)
        procs[1].kill()
        (rc0, _, err0), _ = finish(procs)
        assert rc0 == -signal.SIGKILL, err0[-2000:]
        assert sorted(p.name for p in (folder / "4" / "state").glob("ocdbt.process_*")) == [
            "ocdbt.process_0", "ocdbt.process_1"]
        r = subprocess.run(shard_cmd("--run-dir", "r", "--resume", "--mesh", "fsdp=4", "--simulate-devices", "4"),
                           cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"resumed from step 4 (local snapshot {folder / '4'})" in r.stderr, r.stderr[-3000:]
        want = [rec["loss"] for rec in train(tiny_config("2x4", steps=8), devices=devices_for("2x4"))]
        np.testing.assert_allclose(run_losses(tmp_path / "r")[-4:], want[-4:], rtol=1e-5)
        assert not folder.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@needs_mpi
def test_mpiexec_detects_the_cluster(tmp_path, agreed):
    r = subprocess.run([MPIEXEC, "-n", "2", *shard_cmd(*TINY, *AGREEMENT_ARGS, "--mesh", "2x4", "--run-dir", "r")],
                       cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "in 2 processes" in r.stdout and r.stdout.count("done:") == 1
    assert_same_curves(run_curves(tmp_path / "r"), agreed)


@needs_mpi
@pytest.mark.parametrize("mesh, per_process, extra, resume_at", [
    ("2x4", 4, [], None),
    # One device per process; the trainer's process set (held-out loss on process 0 alone); and a
    # checkpoint written by process 0 at step 2 that both processes resume from.
    ("2x1", 1, ["--eval-every", "1", "--set", "eval.processes=1"], 2),
    # Pipeline stages inside each process, with the config's schedule: the bridge ran 1F1B over 4
    # microbatches whatever the config said (here a microbatch of 1 row, which can't split over data=2).
    ("data=4,stage=2", 4, ["--set", "pipeline.microbatches=2", "--set", "pipeline.schedule=gpipe"], None),
])
def test_mpi_bridge_matches_the_global_mesh(tmp_path, reference, mesh, per_process, extra, resume_at):
    cmd = shard_cmd(*TINY, "--mesh", mesh, "--run-dir", "r", "--cross-host", "mpi", "--set", "observe.peak_tflops=1",
                    *extra)
    if resume_at is not None:
        cmd += ["--checkpoint-every", str(resume_at)]

    def launch(*more):
        r = subprocess.run([MPIEXEC, "-n", "2", *cmd, *more], cwd=tmp_path, env=child_env(), capture_output=True,
                           text=True, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"{per_process} cpu device(s) in each of 2 processes (MPI bridge)" in r.stdout
        return r

    launch()
    if resume_at is not None:  # forget what came after the checkpoint, then take those steps again
        run = tmp_path / "r"
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [str(resume_at), "3"]
        shutil.rmtree(run / "checkpoints" / "3")
        lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
        (run / "metrics.jsonl").write_text("".join(lines[:resume_at]))
        assert f"resumed from step {resume_at}" in launch("--resume").stderr
    evaluated = "--eval-every" in extra
    np.testing.assert_allclose(run_losses(tmp_path / "r"), reference[1 if evaluated else 0], rtol=1e-5)
    np.testing.assert_allclose(run_curves(tmp_path / "r")["grad_norm"], reference[4 if evaluated else 3], rtol=1e-5)
    # MFU over the job's devices (it divided by one process's), and no memory figure where none is known
    from shard.config.flops import mfu_flops_per_token
    from shard.config.presets import PRESETS

    devices = 2 * per_process
    for rec in read_jsonl(tmp_path / "r" / "metrics.jsonl"):
        assert rec["mfu"] == pytest.approx(rec["tokens_per_s"] * mfu_flops_per_token(PRESETS["tiny"], 32) / (devices * 1e12))
        assert "mem_peak_bytes" not in rec
    if evaluated:
        records = read_jsonl(tmp_path / "r" / "metrics.jsonl")
        np.testing.assert_allclose([rec["eval_loss"] for rec in records], reference[2], rtol=1e-5)


@needs_mpi
def test_processes_with_different_cross_host_modes_say_so(tmp_path):
    """Under mpiexec, one process on xla and one on mpi waited out the join timeout without a word
    about why; they compare their modes over MPI before anything else."""
    r = subprocess.run([MPIEXEC, "-n", "1", *shard_cmd(*TINY, "--cross-host", "xla"), ":",
                        "-n", "1", *shard_cmd(*TINY, "--cross-host", "mpi")],
                       cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "different --cross-host (process 0: xla, process 1: mpi)" in r.stderr and "Traceback" not in r.stderr


@needs_mpi
def test_mpi_bridge_refuses_a_model_axis_across_processes(tmp_path):
    r = subprocess.run([MPIEXEC, "-n", "2", *shard_cmd(*TINY, "--mesh", "1x8", "--cross-host", "mpi")],
                       cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=400)
    assert r.returncode != 0, r.stderr[-3000:]
    assert "--cross-host mpi splits only batch axes across processes" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr


PROCESS_SETS = textwrap.dedent("""
    import json, os
    from shard.cluster import launch as cluster, process_sets, runtime
    from shard.errors import ShardError

    ctx = runtime.start(cluster.spec(os.environ), "xla", failure_timeout=30)
    out = {"rank": ctx.rank}
    evens = process_sets.process_set([0, 2], name="evens")
    if evens.includes():
        out["mpi_sum"] = float(evens.allreduce(ctx.rank + 1.0))
        out["xla_sum"] = float(evens._xla_allreduce(__import__("numpy").float32(ctx.rank + 1.0)))
        out["set_rank"] = evens.rank
        out["mesh_procs"] = sorted({d.process_index for d in evens.mesh().devices.flat})
    else:
        try:
            evens.allreduce(1.0)
        except ShardError as e:
            out["non_member"] = str(e)
    pair = process_sets.process_set([1, 2], name="pair")
    pair.destroy()
    try:
        pair.allreduce(1.0)
    except ShardError as e:
        out["destroyed"] = str(e)
    again = process_sets.process_set([1, 2], name="pair")  # the name is free again
    if again.includes():
        out["again"] = float(again.allreduce(10.0))
    out["world"] = float(process_sets.world().allreduce(1.0))
    for ranks in ([0, 2 if ctx.rank == 2 else 1], [0, 0]):  # process 2 disagrees (MPI hung); a repeat
        try:
            process_sets.process_set(ranks, name="odd")
        except ShardError as e:
            out.setdefault("refused", []).append(str(e))
    open(f"sets-{ctx.rank}.json", "w").write(json.dumps(out))
    runtime.finish()
""")


@needs_mpi
def test_process_sets(tmp_path):
    script = tmp_path / "sets.py"
    script.write_text(PROCESS_SETS)
    env = child_env() | {"XLA_FLAGS": xla_flags_for_tests(1)}
    r = subprocess.run([MPIEXEC, "-n", "3", sys.executable, str(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    by_rank = {d["rank"]: d for d in (json.loads(f.read_text()) for f in tmp_path.glob("sets-*.json"))}
    assert set(by_rank) == {0, 1, 2}
    for rank in (0, 2):  # members sum over members only: 1 + 3
        assert by_rank[rank]["mpi_sum"] == 4.0 and by_rank[rank]["xla_sum"] == 4.0
    assert by_rank[0]["set_rank"] == 0 and by_rank[2]["set_rank"] == 1
    assert by_rank[0]["mesh_procs"] == by_rank[2]["mesh_procs"] == [0, 2]
    assert "not a member of process set 'evens'" in by_rank[1]["non_member"]
    assert all("process set 'pair' was destroyed" in d["destroyed"] for d in by_rank.values())
    assert by_rank[1]["again"] == by_rank[2]["again"] == 20.0 and "again" not in by_rank[0]
    assert all(d["world"] == 3.0 for d in by_rank.values())
    for d in by_rank.values():
        assert d["refused"] == ["process 2 created process set 'odd' over ranks [0, 2], process 0 'odd' over [0, 1]; "
                                "create a set on every process with the same ranks and name",
                                "process set ranks repeat: [0, 0]"]


@pytest.mark.parametrize("lost", [1, 0], ids=["worker", "coordinator"])
def test_a_lost_process_stops_the_other(tmp_path, lost):
    """Either process may die: process 0 hosts the coordination service, which outlives it in a helper
    process (shard.cluster.coordinator), so its loss reads like any other."""
    long_run = ["--model", "tiny", "--steps", "100000", "--batch", "8", "--seq", "32", "--log-every", "1",
                "--mesh", "2x1", "--run-dir", "r", "--failure-timeout", "5"]
    procs = explicit(2, long_run, tmp_path, free_ports()[0])
    try:
        metrics = tmp_path / "r" / "metrics.jsonl"
        for _ in range(3000):  # until the first steps are logged (compiling takes a while here)
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2 or procs[0].poll() is not None:
                break
            time.sleep(0.1)
        survivor = procs[1 - lost]
        assert survivor.poll() is None and procs[lost].poll() is None, procs[0].communicate()[1][-3000:]
        procs[lost].send_signal(signal.SIGKILL)
        _, err = survivor.communicate(timeout=60)  # the failure timeout (5 s) plus margin, never a hang
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert survivor.returncode == 3, err[-3000:]
    assert f"error: lost process {lost} of 2" in err
    assert "Check failure" not in err and "Traceback" not in err


def test_a_ctrl_c_to_the_whole_job_saves_and_stops_cleanly(tmp_path):
    """Ctrl-C in a terminal (or a scheduler's preemption signal to the process group) also reached the
    coordination service's helper, which stopped serving mid-step: both processes aborted natively and
    no stop checkpoint was saved. The helper now runs in its own session and ignores those signals."""
    long_run = ["--model", "tiny", "--steps", "100000", "--batch", "8", "--seq", "32", "--log-every", "1",
                "--mesh", "2x1", "--run-dir", "r", "--failure-timeout", "10", "--coordinator", f"127.0.0.1:{free_ports()[0]}",
                "--num-processes", "2"]
    # both processes in one process group of their own, as under a terminal: a parent in a new session
    launcher = ("import json, signal, subprocess, sys\n"
                "signal.signal(signal.SIGINT, lambda *_: None)  # the launcher waits on (its children get it too)\n"
                "procs = [subprocess.Popen(c, stdout=open(f'out{i}', 'w'), stderr=open(f'err{i}', 'w'))"
                " for i, c in enumerate(json.loads(sys.argv[1]))]\n"
                "print(json.dumps([p.wait() for p in procs]))\n")
    cmds = [shard_cmd(*long_run, "--process-id", str(i)) for i in range(2)]
    group = subprocess.Popen([sys.executable, "-c", launcher, json.dumps(cmds)], cwd=tmp_path, env=child_env(),
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        metrics = tmp_path / "r" / "metrics.jsonl"
        for _ in range(3000):
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2 or group.poll() is not None:
                break
            time.sleep(0.1)
        assert group.poll() is None, (tmp_path / "err0").read_text()[-3000:]
        os.killpg(group.pid, signal.SIGINT)
        codes = json.loads(group.communicate(timeout=120)[0])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group.pid, signal.SIGKILL)
    outs = [(code, "", (tmp_path / f"err{i}").read_text()) for i, code in enumerate(codes)]
    for code, _, err in outs:
        assert code == 0, err[-3000:]
        assert "Check failure" not in err and "Traceback" not in err
    saved = [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()]
    assert len(saved) == 1 and int(saved[0]) >= 2, saved  # the step the signal stopped, saved


OOM_AT_STEP_3 = """
from shard.data import batches as data
_next = data.BatchStream.next
def _next_or_oom(self):
    if self.position >= 16:  # the third global batch of 8
        raise MemoryError("simulated on this process only")
    return _next(self)
data.BatchStream.next = _next_or_oom
"""


@pytest.mark.parametrize("failing", [1, 0], ids=["worker", "coordinator"])
def test_a_user_error_on_one_process_is_named_by_the_others(tmp_path, failing):
    """One process runs out of memory mid-run: it stops with its one line (exit 2), and the other says
    why it was lost, not only that it was, and exits with the same code (a restart would meet the same
    error). Process 0 too: the coordination service's helper outlives it, and its reason with it."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(OOM_AT_STEP_3)
    args = ["--model", "tiny", "--steps", "6", "--batch", "8", "--seq", "32", "--log-every", "1", "--mesh", "2x1",
            "--run-dir", "r", "--failure-timeout", "10", "--coordinator", f"127.0.0.1:{free_ports()[0]}",
            "--num-processes", "2"]
    procs = []
    for rank in (0, 1):
        env = child_env()
        if rank == failing:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "inject"), env.get("PYTHONPATH")]))
        procs.append(subprocess.Popen(shard_cmd(*args, "--process-id", str(rank)), cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    (rc0, _, err0), (rc1, _, err1) = finish(procs, timeout=300)
    (rc_failed, err_failed), (rc_other, err_other) = ((rc1, err1), (rc0, err0)) if failing else ((rc0, err0), (rc1, err1))
    assert rc_failed == 2, err_failed[-3000:]
    assert err_failed.count("error:") == 1 and "error: out of memory (simulated on this process only)" in err_failed
    assert rc_other == 2, err_other[-3000:]
    assert f"error: lost process {failing} of 2 (process {failing} stopped on: out of memory (simulated" in err_other, \
        err_other[-3000:]
    assert "Traceback" not in err0 + err1


@pytest.mark.parametrize("failing", [1, 0], ids=["worker", "coordinator"])
def test_an_error_before_joining_reaches_the_others(tmp_path, failing):
    """A data path missing on one host only: that process stops before it joins the cluster, so it
    joins only to leave its reason, and the other names it instead of waiting out the join timeout
    (whose end was a native abort, exit 134). With the default failure timeout (60 s), longer than
    gloo's fixed 30 s, the other must learn it from the reason left, not from a missed heartbeat. The
    corrected command then runs on the same port: the failed run's coordination service is gone (checked
    where process 0, which hosts it, is the one that failed: the other case would start the same run)."""
    port = free_ports()[0]
    args = ["--model", "tiny", "--steps", "3", "--batch", "8", "--seq", "32", "--mesh", "2x1", "--run-dir", "r",
            "--set", "cluster.join_timeout=120", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]

    def start(missing_data_on=None):
        return [subprocess.Popen(shard_cmd(*args, "--process-id", str(rank),
                                           *(["--data", "not-on-this-host.txt"] if rank == missing_data_on else [])),
                                 cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
                for rank in (0, 1)]

    outs = finish(start(missing_data_on=failing), timeout=300)
    (rc_failed, _, err_failed), (rc_other, _, err_other) = outs[failing], outs[1 - failing]
    assert rc_failed == 2, err_failed[-3000:]
    assert err_failed.count("error:") == 1 and "error: data path not-on-this-host.txt does not exist" in err_failed
    assert rc_other == 2, err_other[-3000:]
    assert (f"error: lost process {failing} of 2 (process {failing} stopped on: data path not-on-this-host.txt "
            "does not exist)") in err_other, err_other[-3000:]
    assert "Traceback" not in err_failed + err_other and "Check failure" not in err_failed + err_other
    assert not (tmp_path / "r").exists()
    if failing:
        return
    rerun = finish(start(), timeout=300)
    assert [rc for rc, _, _ in rerun] == [0, 0], rerun[0][2][-3000:] + rerun[1][2][-3000:]


def test_a_process_0_that_gives_up_joining_stops_its_service(tmp_path):
    """Process 0 started alone: one line when the join timeout ends, and its coordination service (the
    helper) stops with it, so the port is free for the corrected command at once."""
    from shard.cluster.coordinator import _check_port_free

    port = free_ports()[0]
    [(rc, _, err)] = finish([subprocess.Popen(
        shard_cmd(*TINY, "--mesh", "2x1", "--run-dir", "r", "--set", "cluster.join_timeout=2",
                  "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"),
        cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)], timeout=120)
    assert rc == 2, err[-3000:]
    assert err.count("error:") == 1 and "could not join the explicit cluster as process 0 of 2" in err, err[-3000:]
    _check_port_free(f"[::]:{port}")  # the helper would hold it for twice the failure timeout


@needs_mpi
def test_an_error_before_joining_under_mpiexec_stops_the_job(tmp_path):
    """Under mpiexec the other ranks wait in MPI's start-up for the failing one: it starts MPI and
    takes the job down, where the job used to hang for ever."""
    script = tmp_path / "rank1_misses_its_data.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from shard.cli.app import main
        if os.environ.get("PMI_RANK") == "1":
            sys.argv += ["--data", "not-on-this-host.txt"]
        main()
    """))
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script), "train", *TINY, "--mesh", "2x1",
                        "--run-dir", "r"], cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "error: data path not-on-this-host.txt does not exist" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_process_reads_only_its_block_of_each_global_batch():
    """With the MPI bridge, process p of P builds rows [p*B/P, (p+1)*B/P) of every global batch, and only
    those samples are read."""
    from shard.data.batches import BatchStream, sample_dataset
    from shard.training.step import batch_sharding
    from shard.testing import fake_mesh

    class Counting:
        def __init__(self, ds):
            self.ds, self.read = ds, []

        def rows(self, start, stop):
            self.read.extend(range(start, stop))
            return self.ds.rows(start, stop)

    from shard.sharding.rules import Layout

    layout = Layout(fake_mesh("2x4"), rules={"batch": ("data",), "length": ()})
    ds = sample_dataset("synthetic", 256, 16, seed=0)
    whole = BatchStream(ds, 8, 16, batch_sharding(layout))
    counting = Counting(ds)
    block = BatchStream(counting, 8, 16, batch_sharding(layout), offset=4, rows=4)
    for _ in range(2):
        full, part = whole.next(), block.next()
        np.testing.assert_array_equal(np.asarray(part["inputs"]), np.asarray(full["inputs"])[4:])
    assert sorted(set(counting.read)) == [4, 5, 6, 7, 12, 13, 14, 15]


def test_eval_rows_are_checked_against_the_local_mesh_before_anything_runs():
    """3 processes with 4 devices each, eval.processes=2, batch 12: training's 4 rows split over data=4,
    but each evaluator's 6 did not, and that failed at the first evaluation, after training steps."""
    from shard.errors import ShardError
    from shard.training.evaluate import eval_rows
    from shard.sharding.rules import Layout
    from shard.testing import fake_mesh

    layout = Layout(fake_mesh("4x1"), rules={"batch": ("data",), "length": ()})
    cfg = tiny_config("4x1", data__batch=12)
    assert eval_rows(cfg, 3, layout) == 4
    with pytest.raises(ShardError, match="6 rows of a global batch of 12, which do not divide over its 4 data-par"):
        eval_rows(cfg, 2, layout)
    with pytest.raises(ShardError, match="global batch 12 does not divide over 5 eval processes"):
        eval_rows(cfg, 5, layout)


def test_bridge_buckets_gradients_instead_of_one_call_per_leaf():
    import jax

    from shard.training.bridge import buckets

    f32 = lambda n: jax.ShapeDtypeStruct((n,), np.float32)  # noqa: E731
    leaves = [f32(10), f32(10), f32(30), jax.ShapeDtypeStruct((4,), np.int32), f32(100), f32(1)]
    # 150-byte buckets: same-dtype neighbours share one until full; a dtype change or an oversized leaf starts anew.
    assert buckets(leaves, 150) == [[0, 1], [2], [3], [4], [5]]
    assert buckets(leaves, 1 << 20) == [[0, 1, 2], [3], [4, 5]]


def test_the_bridge_reports_the_moe_aux_loss_as_one_mesh_does(monkeypatch):
    """The bridge summed each process's MoE auxiliary loss (a mean over its rows) and reported it times
    the process count (2.88 against 1.43 on 2 processes). Two processes with the same rows, faked by an
    all-reduce that doubles, give one mesh's metrics."""
    from types import SimpleNamespace

    import jax

    from shard.training import bridge
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.training.state import init_state, state_spec
    from shard.training.step import make_train_step
    from shard.testing import random_batch

    cfg = tiny_config("1x1", model__name="moe-tiny", model__router_bias_update=0.01, model__moe_routing="capacity")
    layout = make_layout(cfg, parse_mesh("1x1"), devices_for("1x1"))
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout)
    batch = random_batch(cfg.data.batch, cfg.data.seq_len, cfg.model.vocab_size)
    monkeypatch.setattr(bridge, "allreduce_tree", lambda tree, comm, bucket_bytes=0: jax.tree.map(lambda x: 2 * x, tree))
    state_two, two = bridge.make_bridge_step(spec, layout, SimpleNamespace(Get_size=lambda: 2))(
        init_state(spec, cfg.model, cfg.seed), batch)
    state_one, one = make_train_step(spec, layout)(init_state(spec, cfg.model, cfg.seed), batch)
    for key in ("loss", "aux_loss", "grad_norm", "expert_load_min", "expert_load_max", "expert_load_cv"):
        np.testing.assert_allclose(float(two[key]), float(one[key]), rtol=1e-6, err_msg=key)
    assert float(two["tokens_dropped"]) == 2 * float(one["tokens_dropped"])  # both processes' drops
    np.testing.assert_array_equal(state_two["router_bias"], state_one["router_bias"])


def test_a_coordinator_port_in_use_is_refused():
    """gRPC would share a port with a service already there (say a failed run's, still serving its
    last processes): this job's processes could meet that one instead of their own."""
    from shard.cluster.coordinator import _check_port_free
    from shard.errors import ShardError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for address in (f"[::]:{port}", f"127.0.0.1:{port}"):
            with pytest.raises(ShardError, match=f"the coordinator's port {port} is in use"):
                _check_port_free(address)
        _check_port_free(f"127.0.0.2:{port}")  # another interface: free there
    _check_port_free(f"[::]:{port}")  # closed: free again


def test_a_process_stops_even_when_its_stderr_is_gone(monkeypatch):
    """The thread that stops the process exits it whatever happens on the way (a closed stderr here);
    an error it causes in its own thread does not make it wait for itself."""
    import io
    import threading

    from shard.cluster import runtime

    class Exited(BaseException):
        pass

    def exit_(code):
        raise Exited(code)

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    left = []
    monkeypatch.setattr(runtime, "_stopping", threading.Lock())
    monkeypatch.setattr(runtime.os, "_exit", exit_)
    monkeypatch.setattr(runtime.sys, "stderr", ClosedPipe())
    monkeypatch.setattr(runtime, "_leave_service", lambda: left.append(True))
    with pytest.raises(Exited) as exited:
        runtime._lost("lost process 1 of 2", 3)
    assert exited.value.args == (3,) and left == [True]
    waits = []
    monkeypatch.setattr(runtime, "_wait_for_exit", lambda: waits.append(threading.get_ident()))
    waited = threading.Thread(target=runtime.wait_if_stopping)
    waited.start()
    waited.join()
    assert waits == [waited.ident]  # another thread waits for the stopping one to exit the process
    runtime.wait_if_stopping()  # the stopping thread itself goes on
    assert waits == [waited.ident]


def test_a_reason_without_an_exit_code_is_still_named(monkeypatch):
    """A reason left without its exit code (an older shard in the job): named, and exit code 3."""
    from shard.cluster import runtime

    class Client:
        def key_value_try_get(self, key):
            return {"shard/error/1": "out of memory (old format)", "shard/error/2": "2 no such file"}[key]

    stopped = []
    monkeypatch.setattr(runtime.jax_distributed_module().global_state, "client", Client())
    monkeypatch.setattr(runtime, "_ctx", runtime.Context(runtime.XLA, 0, 3))
    monkeypatch.setattr(runtime, "_lost", lambda reason, code=3: stopped.append((reason, code)))
    runtime._stop_on_lost([1], "no reason")
    runtime._stop_on_lost([2], "no reason")
    runtime._stop_on_lost([1, 2], "no reason")
    assert stopped == [
        ("lost process 1 of 3 (process 1 stopped on: out of memory (old format))", 3),
        ("lost process 2 of 3 (process 2 stopped on: no such file)", 2),
        ("lost process 1, 2 of 3 (process 1 stopped on: out of memory (old format); process 2 stopped on: no "
         "such file)", 3),
    ]


def test_an_unreachable_coordinator_is_one_line_not_a_native_abort():
    from shard.cluster.join import _wait_for_coordinator
    from shard.errors import ShardError

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ShardError, match=f"no coordinator answers at 127.0.0.1:{port} after"):
        _wait_for_coordinator(f"127.0.0.1:{port}", timeout=1.0)
    with socket.socket() as s:  # one that listens is found at once
        s.bind(("127.0.0.1", 0))
        s.listen()
        _wait_for_coordinator(f"127.0.0.1:{s.getsockname()[1]}", timeout=1.0)
    # process 0 serves on every interface, but checks that the name the others dial resolves (it waited
    # out the join timeout)
    from shard.cluster.join import _check_resolves

    with pytest.raises(ShardError, match="--coordinator nohost.invalid:1234: unknown host"):
        _check_resolves("nohost.invalid:1234")
    _check_resolves("127.0.0.1:1234")


def test_processes_with_unequal_device_counts_are_named():
    """Hosts with different accelerator counts (on CPU: what --num-processes mismatches led to)."""
    from types import SimpleNamespace

    from shard.run.devices import check_devices_per_process
    from shard.errors import ShardError

    devices = [SimpleNamespace(process_index=p) for p in (0, 0, 0, 0, 1, 1)]
    with pytest.raises(ShardError, match=r"different numbers of devices \(process 0: 4, process 1: 2\)"):
        check_devices_per_process(devices)
    check_devices_per_process(devices[:4] + devices[4:] * 2)


def test_eval_data_on_one_process_only_is_a_config_difference(tmp_path):
    """With the paths left out of the comparison (each is absolute from its own folder), process 1's
    eval.path made one exchange more than process 0's none: the exchanges went out of step."""
    (tmp_path / "held.txt").write_text("held out words " * 100)
    base = [*TINY, "--mesh", "2x4", "--run-dir", str(tmp_path / "r"), "--eval-every", "1"]
    (rc0, _, err0), (rc1, _, err1) = _two(tmp_path, base, [*base, "--set", f"eval.path={tmp_path / 'held.txt'}"])
    assert rc0 == 2 and rc1 == 2, err0[-2000:] + err1[-2000:]
    assert "eval.path is '' on process 0, '<files>' here" in err1, err1[-2000:]


@pytest.mark.parametrize("launcher, env, bind, dialled, bound, gloo", [
    # every process on this host: the service and gloo listen on the loopback interface only
    ("explicit", {}, "auto", "127.0.0.1:{p}", "127.0.0.1:{p}", ("127.0.0.1", None)),
    ("slurm", {"SLURM_STEP_NUM_NODES": "1"}, "auto", "127.0.0.1:{p}", "127.0.0.1:{p}", ("127.0.0.1", None)),
    # across hosts: every interface, as JAX does (the processes dial the first node's name)
    ("slurm", {"SLURM_STEP_NUM_NODES": "2"}, "auto", "node1:{p}", "[::]:{p}", (None, None)),
    ("explicit", {}, "all", "127.0.0.1:{p}", "[::]:{p}", (None, None)),
    ("slurm", {"SLURM_STEP_NUM_NODES": "2"}, "lo", "node1:{p}", "127.0.0.1:{p}", (None, "lo")),
    ("explicit", {"JAX_COORDINATOR_BIND_ADDRESS": "0.0.0.0:9"}, "auto", "127.0.0.1:{p}", "0.0.0.0:9", ("127.0.0.1", None)),
])
def test_the_coordinator_and_gloo_listen_on_loopback_when_every_process_is_local(monkeypatch, launcher, env, bind,
                                                                                 dialled, bound, gloo):
    """They listened on every interface ([::]:PORT, unauthenticated) and the host's external address,
    also for a job whose processes all run on one host."""
    import jax

    from shard.cluster import gloo as gloo_mod
    from shard.cluster import join
    from shard.cluster.launch import ClusterSpec

    port = 7777
    for key in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "JAX_COORDINATOR_BIND_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cluster = ClusterSpec(launcher, 2, 0, f"127.0.0.1:{port}" if launcher == "explicit" else None)
    monkeypatch.setattr(join, "detected_cluster", lambda method, timeout: (f"node1:{port}", 2, 0, None))
    listened, joined = [], []
    monkeypatch.setattr(gloo_mod, "listen_on", lambda host, iface: listened.append((host, iface)))
    monkeypatch.setattr(jax.distributed, "initialize", lambda address, *a, coordinator_bind_address, **kw:
                        joined.append((address, coordinator_bind_address)))
    join._initialize(cluster, 10, 10, bind, join.one_host(cluster))
    assert joined == [(dialled.format(p=port), bound.format(p=port))] and listened == [gloo]


@pytest.mark.parametrize("env, bind, added", [
    # mpiexec with every rank here: MPICH's own sockets (UCX, libfabric) on loopback, as `ss` showed them
    ({"PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"}, "auto", ["FI_PROVIDER", "FI_TCP_IFACE", "UCX_NET_DEVICES"]),
    ({"SLURM_STEP_NUM_NODES": "1"}, "auto", ["FI_PROVIDER", "FI_TCP_IFACE", "UCX_NET_DEVICES"]),
    ({"PMI_SIZE": "4", "MPI_LOCALNRANKS": "2", "UCX_NET_DEVICES": "mlx5_0:1"}, "loopback",
     ["FI_PROVIDER", "FI_TCP_IFACE"]),  # the user's own setting stays
    ({"PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"}, "auto", []),  # ranks on two hosts
    ({"PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"}, "all", []),
    ({"PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"}, "eth1", []),
])
def test_mpich_listens_on_loopback_when_every_rank_is_local(env, bind, added):
    """MPICH's ranks listened on the host's external address too (UCX's TCP transport), also when every
    rank ran on one host; settings MPI reads as it starts keep them on `lo`."""
    from shard.cluster.mpi import LOOPBACK_SOCKETS, loopback_settings

    settings = loopback_settings(env, bind)
    assert sorted(settings) == added and all(settings[k] == LOOPBACK_SOCKETS[k] for k in added)


def test_mpi_starts_with_the_loopback_settings(monkeypatch):
    """The first mpi_world() sets them before mpi4py starts MPI (here a stand-in that only records)."""
    import types

    from shard.cluster import mpi
    from shard.cluster.mpi import LOOPBACK_SOCKETS

    seen = {}
    fake = types.ModuleType("mpi4py")
    fake.__getattr__ = lambda name: seen.update(os.environ) or types.SimpleNamespace(COMM_WORLD="world")
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    for key in [*LOOPBACK_SOCKETS, "SLURM_STEP_NUM_NODES"]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    assert mpi.mpi_world() == "world"
    assert {k: seen.get(k) for k in LOOPBACK_SOCKETS} == LOOPBACK_SOCKETS
