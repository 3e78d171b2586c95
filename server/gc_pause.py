"""Keep the garbage collector's full passes off the frame deadlines.

Python's full collection walks every tracked object while holding the GIL, and the engine thread then stops. A
server with torch, transformers and the model loaded holds about 365,000 objects: a full pass takes about 0.18 s
(measured on the development VM), 13 frames of every duplex stream, and the 30-minute soak lost 22 frames to one.
As vLLM and SGLang do, what is alive once the server has started (modules, weights, calibration) is frozen out of
collection (`gc.freeze`): later passes walk only what was made since. A pass that still takes long is logged.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("s2s.gc")
SLOW_S = 0.05  # a full pass longer than this is logged: it is 4 frames of every stream
_started: dict[str, float] = {}


def freeze_startup_heap() -> None:
    """Collect once, then leave everything alive now out of every later collection; log slow full passes."""
    gc.collect()
    gc.freeze()
    if _timed not in gc.callbacks:
        gc.callbacks.append(_timed)


def _timed(phase: str, info: dict) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        _started["t"] = time.perf_counter()
    elif (seconds := time.perf_counter() - _started.pop("t", time.perf_counter())) > SLOW_S:
        log.warning("a full garbage collection held the engine for %.0f ms", seconds * 1000)
