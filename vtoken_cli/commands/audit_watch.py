"""`vtoken audit URL [URL ...] --watch [--interval S]`: the live view of vtoken.audit.watch.

On a terminal the view is redrawn in place (rich Live); elsewhere each interval prints one plain
line per replica. Ctrl-C ends the watch: the summary is printed and the exit code is 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import typer
from rich.live import Live

from vtoken.audit.watch import Watch
from vtoken.errors import ConfigError
from vtoken_cli.console import stdout
from vtoken_cli.render.watch import summary_lines, watch_lines, watch_summary, watch_view


def watch_command(urls: Sequence[str], interval_s: float, timeout_s: float, refused: Mapping[str, bool]) -> None:
    """Watch `urls` until Ctrl-C; `refused`: the flags given that --watch does not take."""
    given = [flag for flag, is_given in refused.items() if is_given]
    if given:
        raise ConfigError(f"--watch shows the live servers and replays nothing: drop {', '.join(given)}")
    if not interval_s > 0:
        raise ConfigError(f"--interval must be > 0 seconds, got {interval_s:g}")
    not_urls = [u for u in urls if "://" not in u]
    if not_urls:
        raise ConfigError(f"{not_urls[0]}: --watch needs the http:// or https:// URL of a running server")
    watch = Watch(urls, timeout_s)
    try:
        if stdout.is_terminal:
            _watch_live(watch, interval_s)
        else:
            for tick in watch.ticks(interval_s):
                for line in watch_lines(tick):
                    typer.echo(line)
    except KeyboardInterrupt:
        pass
    summary = watch.summary()
    if stdout.is_terminal:
        stdout.print(watch_summary(summary), soft_wrap=False)
    else:
        for line in summary_lines(summary):
            typer.echo(line)


def _watch_live(watch: Watch, interval_s: float) -> None:
    live = Live(console=stdout, auto_refresh=False, transient=False, redirect_stderr=False)
    with live:
        for tick in watch.ticks(interval_s):
            live.update(watch_view(tick, interval_s), refresh=True)
