"""numba for vtoken's compiled loops: one decorator, and what lets vLLM start beside it.

The substrate's round step and live counts (kv/compiled.py) and a policy's selection of its
lowest scores (policies/selection.py) are compiled with `njit`: cached on disk after a
process first compiles them, and free of the GIL. Their modules are imported by their callers
when a process first needs them, so that commands that neither evict nor reclaim pay neither
numba's import nor a compilation.
"""

from __future__ import annotations

import numba
from llvmlite.binding import ffi


def _give_llvmlite_a_namespace() -> None:
    """Make `vars()` of llvmlite's FFI library object a dict, so that vLLM starts beside numba.

    A vLLM 0.32 CPU worker, at `init_worker`, rebinds its Triton kernel overrides by scanning
    every attribute of every module in `sys.modules` and calling `vars(value).get("kernel")` on
    each one that has a `__dict__` (vllm/triton_utils/dispatcher.py, `_rebind_kernels`).
    llvmlite's library object (`llvmlite.binding.ffi.lib`, loaded by numba) has `__slots__` and
    a `__getattr__` that looks every name up as a symbol of its shared library, so `__dict__`
    comes back as one of its function wrappers and the scan raises AttributeError: without this,
    no vLLM engine can start in a process after its first eviction. The wrapper caches the names
    it has looked up in a table, which is read before the library, and an empty dict under
    `__dict__` there answers the scan with "no kernel". tests/test_compiled.py runs the scan
    after the compiled loops ran and fails if llvmlite changes so that this stops holding.
    """
    table = getattr(ffi.lib, "_fntab", None)
    if isinstance(table, dict) and not isinstance(table.get("__dict__"), dict):
        table["__dict__"] = {}


_give_llvmlite_a_namespace()

njit = numba.njit(cache=True, nogil=True)
