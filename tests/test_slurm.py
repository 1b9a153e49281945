"""`srun -n 2 shard train` on a real one-node SLURM cluster started for the test (munge, slurmctld,
slurmd on localhost), and launcher detection from SLURM's and MPI's environment variables.

install.sh installs Debian's slurm-wlm for `dev` when it runs as root; elsewhere the srun test skips.
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shard.cluster.launch import ClusterSpec, detect, spec
from shard.errors import ShardError
from shard.observe.metrics import read_jsonl
from shard.testing import AGREEMENT_ARGS, agreement_config, assert_same_curves, free_ports, train_curves, xla_flags_for_tests

SLURM_BINARIES = ("srun", "slurmctld", "slurmd", "munged", "sinfo")


def _which(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}{os.pathsep}/usr/sbin{os.pathsep}/sbin")


SLURM_CONF = """\
ClusterName=shardtest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM cluster on localhost; yields the environment srun needs. Skips without slurm-wlm."""
    if any(_which(b) is None for b in SLURM_BINARIES) or os.geteuid() != 0:
        pytest.skip("no slurm-wlm here (install.sh dev installs it when run as root on Debian)")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    ctld_port, d_port = free_ports(2)
    conf.write_text(SLURM_CONF.format(d=d, ctld_port=ctld_port, d_port=d_port, cpus=os.cpu_count()))
    env = dict(os.environ, SLURM_CONF=str(conf))
    started: list[subprocess.Popen] = []
    munge_pid = None
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        subprocess.run(["install", "-d", "-o", "munge", "-g", "munge", "/run/munge"], check=True)
        subprocess.run(["runuser", "-u", "munge", "--", _which("munged")], check=True)
        pid_file = Path("/run/munge/munged.pid")
        munge_pid = int(pid_file.read_text()) if pid_file.exists() else None
    try:
        for cmd in ([_which("slurmctld"), "-D", "-f", str(conf)], [_which("slurmd"), "-D", "-N", "localhost", "-f", str(conf)]):
            started.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        # until the node is idle, or a daemon has exited (a configuration it refuses): a cluster that
        # cannot start fails the tests rather than skipping them; the bound only keeps a hang finite
        deadline = time.monotonic() + 300
        while (state := subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                       text=True).stdout.strip()) != "idle":
            exited = [(Path(p.args[0]).name, p.returncode) for p in started if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                pytest.fail(f"the one-node SLURM cluster did not start (state {state!r}; daemons exited: {exited})")
            time.sleep(0.1)
        yield env
    finally:
        for p in started:
            p.terminate()
        for p in started:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if munge_pid:
            os.kill(munge_pid, 15)


def test_srun_two_processes_match_one(slurm, tmp_path):
    # JAX derives srun's coordinator port from the job id, and job ids restart at 1 in every test
    # cluster: a free port (JAX_COORDINATOR_PORT), so an earlier run's lingering service is not met.
    env = dict(slurm, XLA_FLAGS=xla_flags_for_tests(), JAX_COORDINATOR_PORT=str(free_ports()[0]))
    args = ["--model", "tiny", *AGREEMENT_ARGS, "--batch", "8", "--seq", "32", "--log-every", "1", "--mesh", "2x4",
            "--run-dir", "r"]
    r = subprocess.run(["srun", "-n", "2", "-O", "-K", "-I30", sys.executable, "-u", "-m", "shard", "train", *args],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "in 2 processes" in r.stdout and r.stdout.count("done:") == 1  # srun exits 0 even if no task ran
    records = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    assert_same_curves({key: [rec[key] for rec in records] for key in ("loss", "grad_norm")},
                       train_curves(agreement_config("2x4")))


def test_srun_an_error_before_joining_reaches_the_other_task(slurm, tmp_path):
    """Without -K, srun lets the other task run on when one exits: task 1 misses its data, joins only
    to leave its reason, and task 0 names it (it used to wait out the join timeout and abort natively)."""
    env = dict(slurm, XLA_FLAGS=xla_flags_for_tests(), JAX_COORDINATOR_PORT=str(free_ports()[0]))
    script = tmp_path / "task1_misses_its_data.py"
    script.write_text("import os, sys\nfrom shard.cli.app import main\n"
                      "if os.environ['SLURM_PROCID'] == '1':\n    sys.argv += ['--data', 'not-on-this-host.txt']\nmain()\n")
    args = ["--model", "tiny", "--steps", "3", "--batch", "8", "--seq", "32", "--mesh", "2x1", "--run-dir", "r",
            "--set", "cluster.join_timeout=120"]
    r = subprocess.run(["srun", "-n", "2", "-O", "-I30", sys.executable, "-u", str(script), "train", *args],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "error: data path not-on-this-host.txt does not exist" in r.stderr
    assert ("error: lost process 1 of 2 (process 1 stopped on: data path not-on-this-host.txt does not exist); "
            "stopping process 0") in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Check failure" not in r.stderr


def test_shard_launch_recovers_a_killed_task_through_a_new_srun_step(slurm, tmp_path):
    """`shard launch --engine srun`: a task killed with kill -9 takes its step down (srun -K); the
    supervisor starts a new step on the slots left, which resumes the run and finishes it."""
    import json
    import signal

    env = dict(slurm, XLA_FLAGS=xla_flags_for_tests(), PATH=f"{Path(sys.executable).parent}{os.pathsep}{slurm['PATH']}")
    args = ["--model", "tiny", "--mesh", "data=-1,model=2", "--simulate-devices", "2", "--steps", "8", "--batch", "8",
            "--seq", "32", "--log-every", "1", "--checkpoint-every", "2", "--run-dir", "r"]
    with open(tmp_path / "out.txt", "w") as out:
        supervisor = subprocess.Popen([sys.executable, "-m", "shard", "launch", "--engine", "srun", "--processes", "2",
                                       "--", *args], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    metrics, status = tmp_path / "r" / "metrics.jsonl", tmp_path / "r" / ".launch" / "process-1.json"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and len(read_jsonl(metrics)) >= 3 and status.is_file()):
        assert time.monotonic() < deadline and supervisor.poll() is None, (tmp_path / "out.txt").read_text()[-3000:]
        time.sleep(0.2)
    os.kill(json.loads(status.read_text())["pid"], signal.SIGKILL)
    assert supervisor.wait(timeout=400) == 0, (tmp_path / "out.txt").read_text()[-3000:]
    said = (tmp_path / "out.txt").read_text()
    assert "continuing on 1 process, data=1,model=2, from step" in said, said[-3000:]
    assert max(r["step"] for r in read_jsonl(metrics)) == 8


@pytest.mark.parametrize("env, expected", [
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "4", "SLURM_PROCID": "3",
      "SLURM_LOCALID": "1"}, ClusterSpec("slurm", 4, 3)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"}, ClusterSpec("mpi", 2, 1)),  # MPICH Hydra
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8"}, ClusterSpec("mpi", 8, 5)),  # Open MPI
    # mpiexec inside an sbatch script: the batch step's SLURM_PROCID is 0 on every rank; MPI's wins.
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
      "SLURM_LOCALID": "0", "PMI_RANK": "1", "PMI_SIZE": "2"}, ClusterSpec("mpi", 2, 1)),
    ({"SLURM_JOB_ID": "7"}, None),  # an allocation, but not inside a job step
    ({}, None),
])
def test_detect(env, expected):
    assert detect(env) == expected


def test_plan():
    assert spec({"PMI_RANK": "0", "PMI_SIZE": "1"}) is None  # one process: nothing to join
    assert spec({}, "10.0.0.1:1234", 2, 1) == ClusterSpec("explicit", 2, 1, "10.0.0.1:1234")
    with pytest.raises(ShardError, match="go together"):
        spec({}, "10.0.0.1:1234", 2)
    with pytest.raises(ShardError, match="HOST:PORT"):
        spec({}, "10.0.0.1", 2, 0)
    for port in ("177320", "0"):  # bind() raised OverflowError with a traceback; the peer waited to join
        with pytest.raises(ShardError, match=f"--coordinator port must be in 1..65535, got {port}"):
            spec({}, f"10.0.0.1:{port}", 2, 0)
    with pytest.raises(ShardError, match="--process-id must be in 0..1"):
        spec({}, "h:1", 2, 2)
    with pytest.raises(ShardError, match="--num-processes must be 1 or more, got 0"):
        spec({}, "h:1", 0, 0)
    # under mpiexec the flags may repeat what the launcher says, not contradict it (both ranks were 0)
    assert spec({"PMI_RANK": "1", "PMI_SIZE": "2"}, "h:1", 2, 1) == ClusterSpec("explicit", 2, 1, "h:1")
    with pytest.raises(ShardError, match="disagree with the mpi launcher, which started this as process 1 of 2"):
        spec({"PMI_RANK": "1", "PMI_SIZE": "2"}, "h:1", 2, 0)
