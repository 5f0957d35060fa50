"""Fixtures shared by the main tier's test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """Two OpenMP threads on a busy 2-core machine wait on each other (10x slower steps)."""
    from vtoken.checker.observer import torch_threads  # torch only for the modules that ask

    with torch_threads(1):
        yield
