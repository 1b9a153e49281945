"""`shard train`: its flags into one call of shard.run.training_run.run_training, and how the run ended,
printed."""

from typing import Annotated

import typer

from shard.cli.options import ConfigOpt, MeshOpt, ModelOpt, SetOpt, SimOpt, flag_settings
from shard.observe.console import console, err_console

Steps = Annotated[int | None, typer.Option(help="optimizer steps")]
Batch = Annotated[int | None, typer.Option(help="global batch, in sequences")]
Seq = Annotated[int | None, typer.Option(help="sequence length")]
Data = Annotated[str | None, typer.Option(
    help="a token store (shard data prepare), a mixture .toml, text/JSONL/Parquet files, a folder or glob of "
         "them, a saved dataset, .npy/.bin tokens, or 'synthetic'")]
Tokenizer = Annotated[str | None, typer.Option(
    help="byte, a tokenizer.json or a folder with one, or a SentencePiece .model (default: the store's, else byte)")]
Packing = Annotated[str | None, typer.Option(
    help="concat: windows across documents | packed: whole documents per row, attention within each")]
Seed = Annotated[int | None, typer.Option(help="seed for init and data order")]
RunDir = Annotated[str | None, typer.Option("--run-dir", help="where config, metrics and checkpoints go")]
LogEvery = Annotated[int | None, typer.Option("--log-every", help="log every N steps")]
ProfileSteps = Annotated[str | None, typer.Option(
    "--profile-steps", help="profile steps A to B (given as A:B) into RUN_DIR/profile and summarise them")]
CompileCache = Annotated[str | None, typer.Option(
    "--compile-cache", help="persistent compilation cache dir (default: beside the run dir; 'none': off)")]
CheckpointEvery = Annotated[int | None, typer.Option(
    "--checkpoint-every", help="save a checkpoint every N steps (default 1000; 0: off; the last step and preemption always save)")]
Keep = Annotated[int | None, typer.Option("--keep", help="keep the newest K checkpoints")]
Resume = Annotated[bool, typer.Option("--resume", help="continue the run in --run-dir from its newest complete checkpoint")]
AllowFresh = Annotated[bool, typer.Option(
    "--allow-fresh", help="with --resume: start from step 0 when there is no checkpoint yet")]
InitFrom = Annotated[str | None, typer.Option(
    "--init-from", help="start from these weights (a shard checkpoint or a Hugging Face folder)")]
Task = Annotated[str | None, typer.Option(
    "--task", help="pretrain (default) | sft: chat rows, loss on assistant turns | dpo: preference pairs | "
                   "grpo: prompts, rewarded completions sampled each step")]
Reward = Annotated[list[str] | None, typer.Option(
    "--reward", help="task grpo: answer | boxed | last_number | format | module:function, each NAME or NAME=WEIGHT "
                     "(repeat to sum several)")]
Coordinator = Annotated[str | None, typer.Option(help="HOST:PORT of process 0, to start processes by hand (with --num-processes, --process-id)")]
NumProcesses = Annotated[int | None, typer.Option("--num-processes", help="processes in the job (explicit form)")]
ProcessId = Annotated[int | None, typer.Option("--process-id", help="this process's id, 0..N-1 (explicit form)")]
CrossHost = Annotated[str | None, typer.Option("--cross-host", help="xla: one global mesh (default) | mpi: local meshes + MPI all-reduce")]
FailureTimeout = Annotated[float | None, typer.Option("--failure-timeout", help="seconds before a silent process counts as lost (default 60)")]
Bind = Annotated[str | None, typer.Option("--bind", help="where the coordinator and gloo listen: auto (loopback when every process is on this host) | loopback | all | an interface (eth1)")]
EvalEvery = Annotated[int | None, typer.Option("--eval-every", help="held-out loss every N steps, on the eval.processes first processes")]
Wandb = Annotated[str | None, typer.Option(
    "--wandb", help="log to this Weights & Biases project (needs shard[wandb]; [tracking] sets the rest)")]


def train(mesh: MeshOpt = None, model: ModelOpt = None, steps: Steps = None, batch: Batch = None, seq: Seq = None,
          data: Data = None, tokenizer: Tokenizer = None, packing: Packing = None, seed: Seed = None,
          run_dir: RunDir = None, log_every: LogEvery = None, profile_steps: ProfileSteps = None,
          compile_cache: CompileCache = None, checkpoint_every: CheckpointEvery = None, keep: Keep = None,
          resume: Resume = False, allow_fresh: AllowFresh = False, init_from: InitFrom = None, task: Task = None,
          config: ConfigOpt = None, set_: SetOpt = None, simulate_devices: SimOpt = None,
          coordinator: Coordinator = None, num_processes: NumProcesses = None, process_id: ProcessId = None,
          cross_host: CrossHost = None, failure_timeout: FailureTimeout = None, bind: Bind = None,
          eval_every: EvalEvery = None, wandb: Wandb = None, reward: Reward = None):
    """Train a model on a device mesh; under mpiexec or srun, on every process of the job."""
    from shard.run.training_run import RunInterrupted, run_training  # JAX: only once the command runs

    settings = flag_settings(mesh=mesh, model=model, steps=steps, batch=batch, seq=seq, data=data, seed=seed,
                             run_dir=run_dir, simulate_devices=simulate_devices, log_every=log_every,
                             compile_cache=compile_cache, checkpoint_every=checkpoint_every, keep=keep,
                             cross_host=cross_host, failure_timeout=failure_timeout, bind=bind,
                             eval_every=eval_every, init_from=init_from, tokenizer=tokenizer, packing=packing,
                             wandb=wandb, task=task, reward=reward)
    try:
        result = run_training(settings, config_file=config, sets=set_ or [], resume=resume, allow_fresh=allow_fresh,
                              profile_steps=profile_steps, coordinator=coordinator, num_processes=num_processes,
                              process_id=process_id)
    except RunInterrupted as e:  # the newest complete checkpoint, said; out at once
        if e.message:
            err_console.print(e.message, soft_wrap=True)
        raise SystemExit(130) from None
    if result.main:
        print_ending(result)


def print_ending(result) -> None:
    """How a run ended (shard.run.training_run.RunResult): nothing to do; the profile's summary; where a run
    stopped by a signal saved and how to continue it."""
    from shard.measure import profiling
    from shard.run.training_run import NOTHING_TO_DO, STOPPED

    if result.ended == NOTHING_TO_DO:
        console.print(f"nothing to do: the checkpoint is at step {result.start_step} and --steps is "
                      f"{result.config.steps}")
        return
    if result.profile_summary:
        console.print(profiling.format_summary(result.profile_summary), soft_wrap=True)
    if result.ended == STOPPED:
        console.print(f"stopped by {result.stopped_by or 'a signal on another process'} after step "
                      f"{result.last_step}; checkpoint saved to {result.checkpoint or '(no checkpoint)'}; "
                      f"continue with: {result.continue_command}", soft_wrap=True)
