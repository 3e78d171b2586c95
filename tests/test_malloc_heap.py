"""server/malloc_heap.py: freed memory goes back to the system when the heap is trimmed."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, threading
from server.malloc_heap import cap_malloc_arenas, trim_heap

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

cap_malloc_arenas()
kept = []
def churn():  # a worker thread's arena: 200 MB of 2 KiB blocks, then all but one in 64 freed (fragmented)
    blocks = [bytearray(2048) for _ in range(100_000)]
    kept.extend(blocks[::64])
thread = threading.Thread(target=churn)
thread.start()
thread.join()
before = rss_mb()
trimmed = trim_heap()
print(json.dumps({"before": before, "after": rss_mb(), "trimmed": trimmed, "kept": len(kept)}))
"""


def test_trimming_gives_freed_blocks_back() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, cwd=".")
    rss = json.loads(out.stdout)
    assert rss["trimmed"] and rss["kept"] == 1563
    assert rss["before"] - rss["after"] > 100, rss  # of the ~200 MB freed, most was held until the trim


IDLE_SCRIPT = """
import json, threading, time
from server.malloc_heap import cap_malloc_arenas, trim_heap_every

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

cap_malloc_arenas()
idle, kept = [False], []
trim_heap_every(seconds=3600, idle=lambda: idle[0])  # the clock alone would not trim within the test
def churn():
    blocks = [bytearray(2048) for _ in range(100_000)]
    kept.extend(blocks[::64])
thread = threading.Thread(target=churn)
thread.start()
thread.join()
time.sleep(2)  # (the trimmer has polled: still busy)
busy = rss_mb()
idle[0] = True
for _ in range(100):  # the trimmer polls each second
    time.sleep(0.1)
    if busy - rss_mb() > 100:
        break
print(json.dumps({"busy": busy, "idle": rss_mb()}))
"""


def test_the_heap_is_trimmed_when_the_server_falls_idle() -> None:
    out = subprocess.run([sys.executable, "-c", IDLE_SCRIPT], capture_output=True, text=True, check=True, cwd=".")
    rss = json.loads(out.stdout)
    assert rss["busy"] - rss["idle"] > 100, rss
