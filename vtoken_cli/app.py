"""The `vtoken` command: audit, compare and check-invariants.

Each command parses options, builds a config, calls one library function and renders what it
returns. `command` below is the single place where a `VTokenError` becomes a one-line message
on stderr and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import typer
from rich.console import Console
from rich.text import Text

from vtoken.errors import VTokenError

app = typer.Typer(
    name="vtoken",
    help="Measure the KV memory that token-level eviction traps in paged KV caches, and what vToken recovers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

@app.callback()
def _root() -> None:
    """vtoken: token-level KV eviction diagnostics for paged KV caches (vLLM and similar engines)."""


stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)


def command(name: str) -> Callable:
    """Register a command whose `VTokenError`s end as one red line and exit code 2."""

    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except VTokenError as exc:
                stderr.print(Text.assemble(("error: ", "bold red"), str(exc)), highlight=False)
                raise typer.Exit(2) from None

        return app.command(name)(wrapper)

    return decorate


def main() -> None:
    app()


from vtoken_cli import cmd_audit, cmd_check, cmd_compare, cmd_serve  # noqa: E402,F401  (each registers its command)
