"""The `shard` command: the typer app, its commands (one module each) and how every command's user
errors end. JAX is imported only after the simulated device count is settled."""

from inspect import signature
import re

import typer
import typer.core
from rich.markup import escape

from shard.cli.bench import bench_app
from shard.cli.data import data_app
from shard.cli.evaluate import evaluate
from shard.cli.export import export
from shard.cli.generate import generate
from shard.cli.hf import export_hf, import_hf
from shard.cli.inspect import inspect
from shard.cli.launch import launch
from shard.cli.plan import plan
from shard.cli.report import report
from shard.cli.tokenizer import tokenizer_app
from shard.cli.train import train
from shard.errors import ShardError, user_error
from shard.observe.console import err_console
from shard.run import command_end


def _usage_error(e: BaseException) -> ShardError | None:
    """A flag a command can't take (unknown, malformed, missing its value) as one line, like every other
    user error, instead of the usage box. Known by class name: typer bundles its own click, older typer
    uses click's, and both name it UsageError (NoArgsIsHelpError, one of them, is the help: left alone)."""
    if not any(c.__name__ == "UsageError" for c in type(e).__mro__) or type(e).__name__ == "NoArgsIsHelpError":
        return None
    ctx = getattr(e, "ctx", None)
    return ShardError(f"{e.format_message()}" + (f" (see {ctx.command_path} --help)" if ctx else ""))


class CommandGroup(typer.core.TyperGroup):
    """Every command's user errors end the same way: one line on stderr, exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Exception as e:
            command_end.wait_if_stopping()  # another thread is reporting the cause and exits
            error = user_error(e, ctx.invoked_subcommand) or _usage_error(e)
            if error is None:
                raise
            _fail(error)
        finally:  # in-process calls (tests, notebooks) run one command after another
            command_end.forget_expected_cluster()


def _fail(e: Exception):
    err_console.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
    command_end.leave_on_error(str(e), 2)  # several processes: the others learn of it (or the job stops); exits there
    raise typer.Exit(2)


app = typer.Typer(cls=CommandGroup, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train Transformers on any device mesh: the parallel layout is data, not code.")
# In this order in `shard --help` (the bench group after the commands).
app.command()(train)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(launch)
app.command()(export)
app.command()(inspect)
app.command()(plan)
app.add_typer(bench_app, name="bench")
app.command()(report)
app.command()(generate)
app.command("eval")(evaluate)
app.command("import-hf")(import_hf)
app.command("export-hf")(export_hf)
app.add_typer(data_app, name="data")
app.add_typer(tokenizer_app, name="tokenizer")


def _help_in_paragraphs(typer_app: typer.Typer, escaped: set[int]) -> None:
    """typer's help keeps a docstring's line breaks, so a command's line broke where its source did ("as
    its evaluations saw / it"): each paragraph becomes one line, which the help then wraps to the terminal.
    rich reads help text as markup and ate `[wandb]`: every command's, group's and option's help is escaped
    here, once (options shared by several commands are one object, hence `escaped`)."""
    typer_app.info.help = escape(typer_app.info.help) if isinstance(typer_app.info.help, str) else None
    for info in typer_app.registered_commands:
        doc = info.help or (info.callback.__doc__ if info.callback else None) or ""
        info.help = escape("\n\n".join(" ".join(p.split()) for p in re.split(r"\n\s*\n", doc.strip())))
        for param in _parameter_infos(info.callback):
            if isinstance(param.help, str) and id(param) not in escaped:
                escaped.add(id(param))
                param.help = escape(param.help)
    for group in typer_app.registered_groups:
        _help_in_paragraphs(group.typer_instance, escaped)


def _parameter_infos(callback) -> list[typer.models.ParameterInfo]:
    """A command's typer.Option / typer.Argument objects, given in Annotated[...] or as defaults."""
    found = []
    for p in signature(callback).parameters.values() if callback else []:
        found += [m for m in getattr(p.annotation, "__metadata__", ()) if isinstance(m, typer.models.ParameterInfo)]
        found += [p.default] if isinstance(p.default, typer.models.ParameterInfo) else []
    return found


def _flag_type(self, ctx):
    """typer's help showed a flag's type (`--resume <bool>`), though a flag takes no value."""
    return None if self.is_flag or self.count else _option_type(self, ctx)


_help_in_paragraphs(app, set())
_option_type, typer.core.TyperOption.display_type_rich = typer.core.TyperOption.display_type_rich, _flag_type


def main() -> None:
    """The CLI without the huge-page restart (shard.cli.entry:main, the `shard` command, does that first)."""
    app()


if __name__ == "__main__":
    main()
