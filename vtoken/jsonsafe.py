"""JSON-safe values for the `--json` objects the library builds (`vtoken.audit`, `vtoken.compare`)."""

from __future__ import annotations

import math
import numbers
from typing import Any


def make_json_safe(obj: Any) -> Any:
    """`obj` with NaN -> None, tuples -> lists, numpy scalars -> Python numbers, through dicts
    and lists; a new object, `obj` is not changed. Anything else is returned as it is."""
    if isinstance(obj, dict):
        return {k: make_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [make_json_safe(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return None if math.isnan(obj) else float(obj)
    return obj
