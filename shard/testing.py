"""Fixtures shared by tests, notebooks and benchmarks: tiny configs and meshes on simulated devices."""

import contextlib
import os
import socket

from shard.config.resolve import merge, parse_sets, resolve
from shard.config.train import TrainConfig
from shard.startup.devices import HOST_COUNT_FLAG

__all__ = ["FAST_COMPILE_XLA_FLAGS", "AS_USERS_COMPILE", "free_ports", "finish", "xla_flags_for_tests",
           "subprocess_env", "tiny_config", "devices_for", "fake_mesh", "agreement_config", "train_curves",
           "assert_same_curves", "train_losses", "random_batch", "packed_batch", "loss_and_grads",
           "median_step_seconds", "multiple_choice_task"]

# Compiling dominates the test suite on CPU: LLVM at -O0 halves it, and XLA:CPU's older loop emitters in
# place of its MLIR fusion emitters cut what is left to a third (the tiny model's step at -O0: 2.7-3.0 s
# -> 0.9-1.1 s).
# Tests compare runs made under the same flags, so what they check does not depend on them; users' runs
# keep XLA's defaults.
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# ... except where a test measures the compiled program against the cost model: without the fusion
# emitters XLA:CPU moves other bytes (tensor parallel read efficiency 1.25), so those compile as users' do.
AS_USERS_COMPILE = {"xla_cpu_use_fusion_emitters": True}


def free_ports(n: int = 1) -> list[int]:
    """`n` distinct TCP ports free on 127.0.0.1 now: each stays bound until all are chosen, so the OS
    cannot hand the same one out twice."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def finish(procs, timeout: float = 400) -> list[tuple[int, str, str]]:
    """(return code, stdout, stderr) of each child process; any still running when one times out (a
    hang) is killed, so a failed test leaves no process behind."""
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()  # reaped, its pipes closed
    return outs


def xla_flags_for_tests(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process: fast compiling, and `devices` simulated CPU devices if given."""
    return FAST_COMPILE_XLA_FLAGS + (f" {HOST_COUNT_FLAG}={devices}" if devices else "")


def subprocess_env(devices: int | None = None, **extra: str) -> dict:
    """This process's environment for a child process: the simulated device count is left to the child
    (the CLI chooses it, as in a user's shell) unless `devices` is given."""
    return {**os.environ, "XLA_FLAGS": xla_flags_for_tests(devices), **extra}


def tiny_config(mesh: str = "8x1", **sets) -> TrainConfig:
    """The tiny model on `mesh`, 3 steps of batch 8 x 32, in float32 without remat whatever the machine's
    CPU (another model named in `sets` too); `sets` are --set style keys with '__' for '.'.

    >>> tiny_config("2x4", data__batch=16, model__n_kv_heads=4)
    """
    overrides = {"model": {"name": "tiny", "compute_dtype": "float32", "remat": "none"}, "mesh": {"spec": mesh},
                 "steps": 3, "log_every": 1,
                 "data": {"batch": 8, "seq_len": 32}}
    items = [f"{k.replace('__', '.')}={_toml(v)}" for k, v in sets.items()]
    return resolve(merge(overrides, parse_sets(items)))


def _toml(v) -> str:
    import json

    return json.dumps(v) if not isinstance(v, (list, tuple)) else json.dumps(list(v))


def devices_for(mesh: str):
    """The first devices a mesh needs (so a 1x1 mesh runs inside an 8-device test process)."""
    import jax

    from shard.sharding.mesh import devices_needed, parse_mesh

    return jax.devices()[: devices_needed(parse_mesh(mesh), len(jax.devices()))]


def fake_mesh(mesh: str = "2x4"):
    """A jax Mesh from a shard mesh spec over the simulated devices."""
    from shard.sharding.mesh import build_mesh, parse_mesh

    return build_mesh(parse_mesh(mesh), devices_for(mesh))


AGREEMENT_SETS = {"steps": 4, "optimizer__warmup_steps": 0}
AGREEMENT_ARGS = ["--steps", "4", "--set", "optimizer.warmup_steps=0"]  # the same, as `shard train` flags


def agreement_config(mesh: str = "8x1", **sets) -> TrainConfig:
    """tiny_config for runs that must agree (layouts, processes, microbatches): 4 steps and no warm-up, so
    three updates reach the logged losses (a warm-up's first update has learning rate 0); compare
    train_curves, whose grad_norm catches a gradient scaled by a constant, which clipping and AdamW hide
    from the losses."""
    return tiny_config(mesh, **(AGREEMENT_SETS | sets))


def train_curves(cfg: TrainConfig) -> dict[str, list[float]]:
    """Per-step loss and grad_norm of a short run (cfg.log_every should be 1)."""
    from shard.training.loop import train

    records = train(cfg, devices=devices_for(cfg.mesh.spec))
    return {key: [r[key] for r in records] for key in ("loss", "grad_norm")}


def assert_same_curves(got: dict, want: dict, rtol: float = 1e-5, err_msg: str = "") -> None:
    """Two runs' train_curves (or the same keys read from metrics.jsonl) agree at every step."""
    import numpy as np

    assert set(got) == set(want) and len(got["loss"]) == len(want["loss"]), (got, want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=rtol, err_msg=f"{key} {err_msg}")


def train_losses(cfg: TrainConfig) -> list[float]:
    """Per-step losses of a short run (cfg.log_every should be 1)."""
    from shard.training.loop import train

    return [r["loss"] for r in train(cfg, devices=devices_for(cfg.mesh.spec))]


def random_batch(batch: int, seq_len: int, vocab: int, seed: int = 0) -> dict:
    """A deterministic batch of random tokens (numpy), the same on every layout."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((batch, seq_len), np.float32)}


def packed_batch(cfg: TrainConfig) -> dict:
    """random_batch for cfg with packed rows: two documents and three positions of padding per row."""
    import numpy as np

    b = random_batch(cfg.data.batch, cfg.data.seq_len, cfg.model.vocab_size, cfg.seed)
    T = cfg.data.seq_len
    seg = np.ones((cfg.data.batch, T), np.int32)
    seg[:, T // 3:] = 2
    seg[:, T - 3:] = 0
    pos = np.where(seg == 2, np.arange(T) - T // 3, np.arange(T)).astype(np.int32)
    return b | {"mask": (seg > 0).astype(np.float32), "segment_ids": seg, "positions": pos}


def loss_and_grads(cfg: TrainConfig, params: dict | None = None, *, with_hlo: bool = False,
                   packed: bool = False):
    """Mean loss and the gradients of the (summed) training objective for one random batch on cfg's layout
    (pipelined when the mesh has stages), from the given (or freshly initialised) params.

    Compiles only the loss and its gradient, no optimizer or sharded init, so layout tests stay fast.
    `with_hlo` also returns the compiled HLO text (to check which collectives a layout uses).
    `packed`: the batch's rows packed (`packed_batch`)."""
    import jax
    from flax import nnx

    from shard import models
    from shard.training.step import check_batch
    from shard.sharding.layout import make_layout
    from shard.sharding.mesh import parse_mesh
    from shard.sharding.rules import activation_layout
    from shard.training.state import state_spec
    from shard.training.step import batch_sharding, make_loss_fn

    layout = make_layout(cfg, parse_mesh(cfg.mesh.spec), devices_for(cfg.mesh.spec))
    check_batch(cfg, layout)
    spec = state_spec(cfg.model, cfg.optimizer, cfg.steps, layout, lora=cfg.lora)
    if params is None:
        params = nnx.to_pure_dict(nnx.state(models.build(cfg.model, seed=cfg.seed)))
    params = jax.device_put(params, spec.shardings["params"])
    batch = packed_batch(cfg) if packed else random_batch(cfg.data.batch, cfg.data.seq_len, cfg.model.vocab_size,
                                                          cfg.seed)
    batch = jax.device_put(batch, batch_sharding(layout))
    loss_fn = make_loss_fn(spec, layout, cfg.pipeline)

    def f(p, b):
        with activation_layout(layout):
            (_, (nll, count, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, b)
        return nll / count, grads

    compiled = jax.jit(f).lower(params, batch).compile()
    out = jax.device_get(compiled(params, batch))
    return (*out, compiled.as_text()) if with_hlo else out


def median_step_seconds(run, steps: int) -> float:
    """The median wall time of `steps` train steps of a prepared `run` (shard.prepare), after one warm-up
    step; the run keeps the state they leave (its old one was donated)."""
    import statistics
    import time

    import jax

    state, m = run.step_fn(run.state, run.stream.next())  # warm-up
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        batch = run.stream.next()
        t0 = time.perf_counter()
        state, m = run.step_fn(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    run.state = state
    return statistics.median(times)


def multiple_choice_task(folder, name: str, rows: list[dict]):
    """An lm-evaluation-harness task YAML `folder/<name>.yaml` over a JSONL file of `rows` ({"question",
    "choices", "answer"}) beside it, scored by accuracy; returns the YAML's path."""
    import json
    from pathlib import Path

    folder = Path(folder)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = folder / f"{name}.yaml"
    task.write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return task
