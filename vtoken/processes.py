"""Child processes that end with the process that started them: the runners' worker processes
and the token reports' manager (runners.py), and `vtoken serve`'s vLLM server
(engine/vllm/serve.py). A command killed outright (SIGKILL, the OOM killer) runs none of its
own cleanup; on Linux the kernel sends its children the signal they asked for (prctl(2),
PR_SET_PDEATHSIG) instead.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends


def end_with_parent(parent_pid: int) -> None:
    """In a child process, on Linux: SIGTERM when `parent_pid`, the process that started it,
    ends, however it ends (killed outright, it runs no cleanup of its own), so that no worker
    replays on and no server serves on for nobody. A no-op elsewhere. Usable as
    `subprocess.Popen`'s preexec_fn: the signal survives the exec."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # it ended before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)
