"""`shard launch`: supervise a training job (shard.run.elastic.launch): start its workers, restart them at
the size that fits when one is lost, grow the job when hosts come back."""

from typing import Annotated

import typer

from shard.cli.options import FLAG_KEYS, flag_settings
from shard.observe.console import console


def launch(
    ctx: typer.Context,
    processes: Annotated[int | None, typer.Option("--processes", help="processes to start with (default: every slot)")] = None,
    min_processes: Annotated[int, typer.Option("--min-processes", help="the fewest the job may shrink to")] = 1,
    max_processes: Annotated[int | None, typer.Option("--max-processes", help="the most it may grow to (default: --processes)")] = None,
    devices_per_process: Annotated[int | None, typer.Option(
        "--devices-per-process", help="accelerators in each process (default: the train arguments' --simulate-devices)")] = None,
    hosts: Annotated[str | None, typer.Option("--hosts", help="a file of HOST or HOST:SLOTS lines")] = None,
    host_discovery: Annotated[str | None, typer.Option(
        "--host-discovery", help="a script that prints the HOST or HOST:SLOTS lines there are now")] = None,
    discovery_interval: Annotated[float, typer.Option(
        "--discovery-interval", help="seconds between two questions to --host-discovery")] = 2.0,
    elastic_timeout: Annotated[float, typer.Option(
        "--elastic-timeout", help="with --host-discovery: seconds to wait for enough slots after a loss")] = 600.0,
    max_restarts: Annotated[int, typer.Option("--max-restarts", help="restarts after lost processes before giving up")] = 3,
    engine: Annotated[str, typer.Option("--engine", help="local (processes here) | srun (steps of a SLURM allocation) | mpiexec")] = "local",
):
    """Start a training job, watch it, and restart it on the processes left when one is lost (from its
    newest checkpoint or local snapshot, on a mesh with one -1 axis), or grow it when hosts come back.

    Usage: shard launch [OPTIONS] -- TRAIN_ARGUMENTS (what shard train takes; --run-dir is required)."""
    from shard.run.elastic import LaunchOptions
    from shard.run.elastic import launch as launch_job

    params = _train_params(ctx.args)
    settings = flag_settings(**{k: v for k, v in params.items() if k in FLAG_KEYS})
    options = LaunchOptions(processes=processes, min_processes=min_processes, max_processes=max_processes,
                            devices_per_process=devices_per_process, hosts_file=hosts, discovery=host_discovery,
                            max_restarts=max_restarts, engine=engine, discover_every_s=discovery_interval,
                            elastic_timeout_s=elastic_timeout)
    code = launch_job(list(ctx.args), settings, config_file=params.get("config"), sets=params.get("set_") or [],
                      options=options, say=lambda line: console.print(line, soft_wrap=True))
    raise typer.Exit(code)


def _train_params(args: list[str]) -> dict:
    """The train arguments parsed as `shard train` parses them (a bad one: the same one-line error)."""
    from shard.cli.train import train

    only = typer.Typer(add_completion=False)
    only.command()(train)
    with typer.main.get_command(only).make_context("shard launch -- (train)", list(args)) as parsed:
        return dict(parsed.params)
