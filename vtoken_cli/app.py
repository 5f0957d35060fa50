"""The `vtoken` command: builds the typer app and registers the commands of vtoken_cli/commands/.

Every command is wrapped in `console.one_line_errors` here, the single place where a
`VTokenError` becomes a one-line message on stderr and exit code 2.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Annotated

import typer

from vtoken_cli.commands.audit import audit_command
from vtoken_cli.commands.check import check_command
from vtoken_cli.commands.compare import compare_command
from vtoken_cli.commands.serve import serve_command_line
from vtoken_cli.console import one_line_errors, stdout

COMMANDS = {
    "audit": audit_command,
    "check-invariants": check_command,
    "compare": compare_command,
    "serve": serve_command_line,
}

app = typer.Typer(
    name="vtoken",
    help="Measure the KV memory that token-level eviction traps in paged KV caches, and what vToken recovers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
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


def main() -> None:
    app(prog_name="vtoken")
