"""Golden `--json` output of the README's commands: the quick start, both paper-frontier runs
and the default `check-invariants`.

Changed only in a commit that names the fix that changes them: regenerate with
`python tests/test_golden_cli.py`. Wall-clock fields (how long the run took) are left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIR = Path(__file__).parent / "golden" / "cli"
WALL_CLOCK_KEYS = frozenset({"elapsed_s", "relocation_events_per_s"})

COMMANDS = {
    "quickstart": ["compare", "sample_traces/azure_conv_sample.csv", "--num-blocks", "2000"],
    "frontier_5427": ["compare", "sample_traces/paper_frontier.jsonl", "--num-blocks", "5427", "--no-sweep",
                      "--concurrencies", "4,5,6,7,8,9,10,11"],
    "frontier_11519": ["compare", "sample_traces/paper_frontier.jsonl", "--num-blocks", "11519", "--no-sweep",
                       "--concurrencies", "10,11,12,16,17,18,22,23"],
    "check_invariants": ["check-invariants"],
}


def without_wall_clock(value):
    if isinstance(value, dict):
        return {k: without_wall_clock(v) for k, v in value.items() if k not in WALL_CLOCK_KEYS}
    if isinstance(value, list):
        return [without_wall_clock(v) for v in value]
    return value


def run_json(args: list[str]) -> dict:
    from vtoken_cli.app import app

    result = CliRunner().invoke(app, [*args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return without_wall_clock(json.loads(result.stdout))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_json_output_is_unchanged(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    expected = json.loads((GOLDEN_DIR / f"{name}.json").read_text())
    assert run_json(COMMANDS[name]) == expected


if __name__ == "__main__":
    import os

    os.chdir(ROOT)
    for name in sys.argv[1:] or sorted(COMMANDS):
        (GOLDEN_DIR / f"{name}.json").write_text(json.dumps(run_json(COMMANDS[name]), indent=2, sort_keys=True) + "\n")
