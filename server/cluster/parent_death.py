"""The cluster's children (HAProxy, the replicas) end when `s2s cluster` does, however it ends, SIGKILL included:
between fork and exec each asks Linux for SIGTERM when its parent goes (`PR_SET_PDEATHSIG`, kept across exec).

The signal comes when the *thread* that forked the child ends, not the process: the cluster forks from its main
thread, which lives as long as it does (`die_with_parent` refuses any other)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None  # loaded before any fork


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen`, called in the main thread: the child gets SIGTERM when this process
    ends. None where there is no such signal (not Linux)."""
    if _prctl is None:
        return None
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("a child that dies with its parent is forked from the main thread (PR_SET_PDEATHSIG)")
    parent = os.getpid()

    def preexec() -> None:
        if _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")  # Popen raises it in the parent
        if os.getppid() != parent:  # the parent went between the fork and the prctl: no signal would come
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
