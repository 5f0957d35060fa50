"""Start-up: importing the CLI and rendering `--help` of `vtoken` and of every command imports
neither torch, matplotlib, transformers nor pandas; a command imports them when it runs. Checked
in a fresh interpreter: this test session has imported all of them already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# argv: modules to import first. Prints {step: the heavy modules imported after it}.
PROBE = """
import json, sys
from typer.testing import CliRunner

for module in sys.argv[1:]:
    __import__(module)
import vtoken_cli.app as cli

HEAVY = ("torch", "matplotlib", "transformers", "pandas")
loaded = {"import vtoken_cli.app": [m for m in HEAVY if m in sys.modules]}
for args in [["--help"]] + [[c.name, "--help"] for c in cli.app.registered_commands]:
    result = CliRunner().invoke(cli.app, args)
    if result.exit_code != 0:
        raise SystemExit(f"vtoken {' '.join(args)} exited {result.exit_code}: {result.output}")
    loaded["vtoken " + " ".join(args)] = [m for m in HEAVY if m in sys.modules]
print(json.dumps(loaded))
"""


def heavy_modules_after_each_step(*preloaded: str) -> dict[str, list[str]]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *preloaded], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_import_and_every_help_load_no_heavy_module():
    loaded = heavy_modules_after_each_step()

    steps = ["import vtoken_cli.app", "vtoken --help", "vtoken audit --help", "vtoken check-invariants --help",
             "vtoken compare --help", "vtoken serve --help"]
    assert set(steps) <= set(loaded)
    assert loaded == {step: [] for step in loaded}


def test_the_probe_reports_a_heavy_module_that_was_imported():
    loaded = heavy_modules_after_each_step("torch")

    assert "torch" in loaded["import vtoken_cli.app"]
    assert "torch" in loaded["vtoken check-invariants --help"]
