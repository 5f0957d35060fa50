"""Where vtoken keeps what it creates outside a run's --output: one cache root, read from the
environment at call time.

    cache_root()      $VTOKEN_CACHE_DIR, else $XDG_CACHE_HOME/vtoken, else ~/.cache/vtoken
      <root>/smollm2-135m-instruct/   the converted SmolLM2 (vtoken.models.smollm2)
      <root>/runs/                    the sim replay cache (vtoken.cache), unless
                                      $VTOKEN_RUN_CACHE_DIR names another directory
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("VTOKEN_CACHE_DIR"):
        return Path(os.environ["VTOKEN_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "vtoken"


def run_cache_dir() -> Path:
    if os.environ.get("VTOKEN_RUN_CACHE_DIR"):
        return Path(os.environ["VTOKEN_RUN_CACHE_DIR"]).expanduser()
    return cache_root() / "runs"


def run_cache_dir_source() -> str:
    """Where `run_cache_dir()` came from, for a message that names it."""
    for name in ("VTOKEN_RUN_CACHE_DIR", "VTOKEN_CACHE_DIR", "XDG_CACHE_HOME"):
        if os.environ.get(name):
            return f"${name}"
    return "the run cache"
