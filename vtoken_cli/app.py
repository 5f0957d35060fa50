"""The `vtoken` command: builds the typer app and registers the commands of vtoken_cli/commands/.

Every command is wrapped in `console.one_line_errors` here, the single place where a
`VTokenError` becomes a one-line message on stderr and exit code 2.
"""

from __future__ import annotations

import signal
import sys
from importlib.metadata import version
from typing import Annotated

import click
import typer
from typer.core import TyperGroup

try:  # typer 0.2x parses with its own copy of click, whose exceptions are not click's
    from typer._click import exceptions as _typer_click
except ImportError:  # an older typer on click itself
    _typer_click = click.exceptions

_USAGE_ERRORS = (click.ClickException, _typer_click.ClickException)
_NO_ARGS = (click.exceptions.NoArgsIsHelpError, _typer_click.NoArgsIsHelpError)
_ABORT = (click.exceptions.Abort, getattr(_typer_click, "Abort", click.exceptions.Abort))

from vtoken_cli.commands.audit import audit_command
from vtoken_cli.commands.calibrate import calibrate_command
from vtoken_cli.commands.check import check_command
from vtoken_cli.commands.compare import compare_command
from vtoken_cli.commands.paper import paper_command
from vtoken_cli.commands.serve import serve_command_line
from vtoken_cli.commands.sweep import sweep_command
from vtoken_cli.commands.validate import validate_command
from vtoken_cli.console import one_line_errors, stderr, stdout

COMMANDS = {
    "audit": audit_command,
    "calibrate": calibrate_command,
    "check-invariants": check_command,
    "compare": compare_command,
    "paper": paper_command,
    "serve": serve_command_line,
    "sweep": sweep_command,
    "validate": validate_command,
}



class OneLineUsageErrors(TyperGroup):
    """A usage error (a flag's value of the wrong type, an unknown flag or command, a missing
    argument) is one line on stderr and exit code 2, as every other bad input is, instead of
    click's usage box."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except _NO_ARGS as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except _USAGE_ERRORS as exc:
            where = f" (see '{exc.ctx.command_path} -h')" if getattr(exc, "ctx", None) is not None else ""
            stderr.print(f"[bold red]error:[/] {exc.format_message()}{where}", highlight=False)
            sys.exit(exc.exit_code)
        except _ABORT:
            stderr.print("aborted", highlight=False)
            sys.exit(130)
        sys.exit(result if isinstance(result, int) else 0)


app = typer.Typer(
    cls=OneLineUsageErrors,
    name="vtoken",
    help="Measure the KV memory that token-level eviction traps in paged KV caches, and what vToken recovers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
for name, func in COMMANDS.items():
    app.command(name)(one_line_errors(func))


def _print_version(is_given: bool) -> None:
    if is_given:
        stdout.print(f"vtoken {version('vtoken')}", highlight=False, markup=False)
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[bool, typer.Option(
        "--version", help="Print the version and exit.", callback=_print_version, is_eager=True)] = False,
) -> None:
    """vtoken: token-level KV eviction diagnostics for paged KV caches (vLLM and similar engines)."""


TERMINATED_EXIT_CODE = 128 + signal.SIGTERM
_sigterm_received = False  # Ray's wait ends a wait the signal interrupted with a SystemExit(1) of its own


def main() -> None:
    signal.signal(signal.SIGTERM, _terminated)
    try:
        app(prog_name="vtoken")
    except SystemExit:
        if _sigterm_received:  # the exit code is the signal's, whatever ended the unwinding
            raise SystemExit(TERMINATED_EXIT_CODE) from None
        raise


def _terminated(signum: int, frame) -> None:
    """SIGTERM (kill, a scheduler's time limit) ends a command as Ctrl-C does, unwinding: the
    worker processes, a Ray cluster and a server it started end with it, and an --output it was
    writing is not left half-written."""
    global _sigterm_received
    _sigterm_received = True
    raise SystemExit(TERMINATED_EXIT_CODE)
