"""`shard train`'s terminal output: the start-up summary, a progress bar (one plain line per logged step
when the output is a file: a batch job's log), and the closing line."""

from contextlib import contextmanager
from pathlib import Path

from rich.markup import escape

from shard.observe.console import console, err_console, human_bytes, param_count, params_phrase, short_bytes
from shard.errors import ShardError
from shard.hardware import FLOP_SHARE_ERROR
from shard.training.observer import Observer


@contextmanager
def compiling_line():
    """`compiling the train step…` while the step compiles (15-50 s for a big model on a cold cache): on a
    terminal with the time elapsed so far, in a log file as one line (the summary then says how long)."""
    if not console.is_terminal:
        console.print("compiling the train step…", soft_wrap=True)
        yield
        return
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("compiling the train step…"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        progress.add_task("compile", total=None)
        yield


def sequence_parallel(layout) -> str:
    """` · sequence parallel (...)` where the residual stream is split along length, else ''."""
    axes = layout.describe_axes("res_length")
    return f" · sequence parallel: norms and residual adds split along length on {axes}" if axes else ""


def clock(seconds: float) -> str:
    """A duration as a clock reads it: 0:05:12, 26:40:00."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def moe_fields(r: dict) -> list[str]:
    """A MoE step's balance, compactly: the aux loss per layer (1: balanced), the least and most loaded
    expert as a share of the mean (1: balanced), and with capacity routing the pairs dropped."""
    out = [f"aux {r['aux_loss']:.3f}"] if r.get("aux_loss") is not None else []
    if r.get("expert_load_min") is not None and r.get("expert_load_max") is not None:
        out.append(f"load {r['expert_load_min']:.2f}-{r['expert_load_max']:.2f}")
    if r.get("tokens_dropped"):
        out.append(f"dropped {r['tokens_dropped']:,.0f}")
    return out


def health_fields(r: dict) -> list[str]:
    """MFU and the hardware FLOP share HFU (where a peak is known), and the busiest device's peak memory
    (`~`: XLA's compiled estimate)."""
    out = [f"MFU {r['mfu']:.1%}"] if r.get("mfu") is not None else []
    if r.get("hfu") is not None:
        out.append(f"HFU {r['hfu']:.1%}")
    if r.get("mem_peak_bytes"):
        out.append(f"mem {'~' if r.get('mem_source') == 'compiled' else ''}{short_bytes(r['mem_peak_bytes'])}")
    return out


def step_line(r: dict, steps: int, evaluated: str = "") -> str:
    """A logged step as one line of a log file, in torchtitan's and MaxText's manner: loss, speed, MFU,
    memory, a MoE's balance, then the time this start has run and the time left at the latest speed."""
    left = (steps - r["step"]) * r["step_time_s"] if r.get("step_time_s") is not None else None
    timing = ([f"{clock(r['time_s'])} elapsed"] if r.get("time_s") is not None else []) \
        + ([f"ETA {clock(left)}"] if left is not None else [])
    return " · ".join([f"step {r['step']}/{steps}", f"loss {r['loss']:.4f}{evaluated}",
                       f"{r['tokens_per_s']:,.0f} tokens/s", *health_fields(r), *moe_fields(r)]
                      + ([", ".join(timing)] if timing else []))


class ConsoleProgress(Observer):
    """Startup summary, a progress bar with loss, tokens/s, MFU, memory, a MoE's balance, the time elapsed
    and left, and a closing line. Where the output is not a terminal, a bar is drawn only once it ends;
    each logged step gets a line there instead (step_line)."""

    def __init__(self, cfg, run_dir: Path):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.cfg, self.run_dir, self.run = cfg, run_dir, None
        self.progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("{task.fields[more]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console,
        ) if console.is_terminal else None
        if self.progress:
            self.task = self.progress.add_task("train", total=cfg.steps, loss="-", tps="-", more="")

    def on_start(self, run) -> None:
        self.run, self.run_start = run, run.at_step
        if self.progress:
            self.progress.update(self.task, completed=run.at_step)
        cfg = self.cfg
        mesh = ",".join(f"{k}={v}" for k, v in run.mesh.shape.items())
        kind = run.mesh.devices.flat[0].platform
        from shard.cluster import runtime

        ctx = runtime.context()
        where = f"{run.mesh.size} {kind} device(s)"
        if ctx.mode == runtime.XLA:
            where += f" in {ctx.size} processes ({run.mesh.size // ctx.size} per host)"
        elif ctx.mode == runtime.MPI:
            where = f"{run.mesh.size} {kind} device(s) in each of {ctx.size} processes (MPI bridge)"
        peak = run.compiled_memory.get("total")
        compiled = "on the first step" if run.compile_s is None else f"in {run.compile_s:.1f}s"
        console.print(
            f"mesh {mesh} on {where}" + sequence_parallel(run.layout)
            + f" · model {cfg.model.name} ({params_phrase(cfg.model)})"
            + (f" · LoRA rank {cfg.lora.rank} on {', '.join(cfg.lora.targets)} ({param_count(_trained(run))} "
               "params trained)" if run.spec.lora is not None else "")
            + f" · global batch {cfg.data.batch}x{cfg.data.seq_len} = {cfg.data.batch * cfg.data.seq_len:,} tokens"
            + (f" · pipeline {p['schedule']}, {p['stages']} stages x {p['microbatches']} microbatches, "
               f"bubble {p['bubble']:.1%}" if (p := run.pipeline) else "")
            + (f" · ~{human_bytes(peak)} per device (compiled estimate)" if peak else "")
            + f" · step compiled {compiled}", soft_wrap=True)
        if run.peak_flops is None:
            console.print(f"[dim]MFU not reported: no peak FLOP/s known for {kind} devices (set one with "
                          "--set observe.peak_tflops=X; on a CPU, measure it: python benchmarks/peak.py)[/dim]",
                          soft_wrap=True, markup=True)
        if run.hardware is not None:
            from shard.measure.plan import startup_warnings

            hosts = ctx.size if ctx.mode == runtime.XLA else 1  # the MPI bridge's mesh is this host's
            try:
                warnings = startup_warnings(cfg, dict(run.mesh.shape), run.hardware, hosts)
            except ShardError:  # a layout the cost model cannot describe gets no advice, not an error
                warnings = []
            for w in warnings:
                console.print(f"[yellow]warning:[/yellow] {escape(w)}", soft_wrap=True, markup=True)
        from shard.data.batches import data_summary, repetition_note

        console.print(escape(data_summary(cfg, run.stream.dataset)), soft_wrap=True)

        if note := repetition_note(run.stream.dataset, cfg.data.batch, cfg.data.seq_len):
            console.print(f"[yellow]warning:[/yellow] {escape(note)}", soft_wrap=True, markup=True)
        if self.progress:
            self.progress.start()

    def on_step(self, step: int, outputs=None) -> None:
        if self.progress:
            self.progress.update(self.task, completed=step)

    def on_log(self, r: dict) -> None:
        evaluated = f" · eval loss {r['eval_loss']:.4f}" if "eval_loss" in r else ""
        if "reward_margin" in r:  # a DPO run's
            evaluated += (f" · reward margin {r['reward_margin']:.4f} (chosen {r['reward_chosen']:.4f}, rejected "
                          f"{r['reward_rejected']:.4f}) · accuracy {r['accuracy']:.2f}")
        if "completion_length" in r:  # a GRPO run's
            evaluated += (f" · reward {r['reward']:.4f} ± {r['reward_std']:.4f} · kl {r['kl']:.4f} · entropy "
                          f"{r['entropy']:.3f} · clipped {r['clip_low']:.2f}/{r['clip_high']:.2f} · length "
                          f"{r['completion_length']:.1f} · "
                          f"filtered {r['filtered']:.0%} · rollout {r['rollout_tokens_per_s']:,.0f} tokens/s")
        if FLOP_SHARE_ERROR in r:
            (self.progress.console if self.progress else err_console).print(
                f"[yellow]warning: {escape(r[FLOP_SHARE_ERROR])}[/yellow]", soft_wrap=True)
        if self.progress:
            self.progress.update(self.task, loss=f"{r['loss']:.4f}", tps=f"{r['tokens_per_s']:,.0f}",
                                 more=" · ".join(health_fields(r) + moe_fields(r)))
            if evaluated:  # above the bar
                self.progress.console.print(f"step {r['step']}{evaluated}", soft_wrap=True)
        else:
            console.print(step_line(r, self.cfg.steps, evaluated), soft_wrap=True)

    def on_abort(self) -> None:  # the error that follows gets a clean line
        if self.progress:
            self.progress.stop()

    def on_end(self, records: list[dict]) -> None:
        self.on_abort()
        if not records:
            return
        last = records[-1]
        losses = f"{last['loss']:.3f}" if len(records) == 1 else f"{records[0]['loss']:.3f} -> {last['loss']:.3f}"
        ran = last["step"] - self.run_start
        steps = f"{ran} step" + ("s" if ran != 1 else "")
        if self.run_start:
            span = f"{self.run_start + 1}-{last['step']}" if ran > 1 else str(last["step"])
            steps += f" ({span}, resumed)"
        evaluated = [r["eval_loss"] for r in records if "eval_loss" in r]
        ended = "stopped early" if self.run is not None and self.run.stopped_at is not None else "done"
        console.print(f"{ended}: {steps}, loss {losses}" + (f", eval loss {evaluated[-1]:.3f}" if evaluated else "")
                      + f", {last['tokens_per_s']:,.0f} tokens/s; run dir {self.run_dir}", soft_wrap=True)
        if last.get("skipped_steps"):
            every = " (every one of them: no update was applied)" if last["skipped_steps"] >= ran else ""
            err_console.print(f"[yellow]guard.action=skip dropped the update of {last['skipped_steps']} of the "
                              f"{ran} steps run{every}[/yellow]", soft_wrap=True)


def _trained(run) -> int:
    """The parameters the optimizer updates (under LoRA, the adapters)."""
    import math

    import jax

    return sum(math.prod(a.shape) for a in jax.tree.leaves(run.spec.trainable(run.spec.abstract["params"])))
