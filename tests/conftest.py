"""Fixtures shared by the main tier's test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """Two OpenMP threads on a busy 2-core machine wait on each other (10x slower steps)."""
    from vtoken.checker.observer import torch_threads  # torch only for the modules that ask

    with torch_threads(1):
        yield


@pytest.fixture(autouse=True)
def fresh_run_cache(tmp_path_factory, monkeypatch):
    """Every test replays what it asks for: the on-disk run cache (vtoken/cache.py) starts empty
    in a directory of its own, so a result cached by one test never stands in for another's.
    The rest of vtoken's cache root (the converted SmolLM2) stays the user's."""
    monkeypatch.setenv("VTOKEN_RUN_CACHE_DIR", str(tmp_path_factory.mktemp("run-cache")))
