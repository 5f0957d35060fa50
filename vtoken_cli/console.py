"""Where the commands write, and the one place a library error becomes a message.

Data goes to `stdout`, progress and diagnostics to `stderr`. `one_line_errors` turns a
`VTokenError` into one red line on stderr and exit code 2; anything else is a bug and keeps its
traceback. app.py wraps every command in it when it registers them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import typer
from rich.console import Console
from rich.text import Text

from vtoken.errors import VTokenError

stdout = Console()  # long lines wrap at the width (COLUMNS, else the terminal, else 80); print_json does not wrap
stderr = Console(stderr=True, soft_wrap=True)


def one_line_errors(func: Callable) -> Callable:
    """`func`, whose `VTokenError`s end as one red line on stderr and exit code 2."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except VTokenError as exc:
            stderr.print(Text.assemble(("error: ", "bold red"), str(exc)), highlight=False)
            raise typer.Exit(2) from None

    return wrapper
