"""A module imported at the first call that needs it, then held.

The compiled loops' modules (kv/compiled.py, engine/sim_compiled.py, policies/selection.py)
import numba, which a replay that neither evicts nor reclaims never needs: their callers reach
them through `imported_at_first_call`, so that importing the pool, the sim or the policies does
not import numba. An import statement inside a function would run at every call (every eviction
event); the module is held after the first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType


def imported_at_first_call(name: str) -> Callable[[], ModuleType]:
    """A function of no arguments that returns module `name`, importing it at its first call."""
    module: ModuleType | None = None

    def get() -> ModuleType:
        nonlocal module
        if module is None:
            module = importlib.import_module(name)
        return module

    get.__doc__ = f"{name}, imported at the first call (numba with it), then held."
    return get
