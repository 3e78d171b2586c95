"""A careless operator (issue 45): a restart with `--frontends` after a busy run, a start on a port something else
holds, a local process that talks to a replica of `s2s cluster` directly with a made-up `X-Forwarded-For`, and a
SIGKILL of `s2s cluster` followed by a second one on its port."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from bench.hostile.clients import Listener
from server.moshi.client import refusal_of
from server.ports import free_port
from server.process import ServerProcess

START_TIMEOUT_S = 300.0


def run_folders() -> set[str]:
    """The `--frontends` run folders in the servers' temporary folder (`operators`' own)."""
    return set(glob.glob(os.path.join(os.environ["TMPDIR"], "s2s-*")))


def time_wait(port: int) -> int:
    """Sockets in TIME-WAIT on local `port`."""
    out = subprocess.run(
        ["ss", "-Htan", "state", "time-wait", f"( sport = :{port} )"], capture_output=True, text=True
    ).stdout
    return len(out.splitlines())


def busy(url: str, requests: int) -> None:
    """`requests` /healthz requests, each on its own connection: the server closes each first, so its side of each
    is left in TIME-WAIT."""
    for _ in range(requests):
        try:
            with urllib.request.urlopen(url.replace("ws://", "http://") + "/healthz", timeout=10) as r:
                r.read()
        except OSError:
            pass  # 503: a full server answers too


def start(*args: str) -> tuple[str, int | None]:
    """What `s2s serve ARGS` did: "serving" (then stopped) or its last line, and its exit status (None: serving)."""
    server = ServerProcess(*args, timeout_s=START_TIMEOUT_S)
    try:
        with server:
            return "serving", None
    except RuntimeError:
        lines = [line.strip() for line in server.output.splitlines() if line.strip()]
        return (lines[-1] if lines else "(no output)"), server.proc.returncode


def restart(busy_requests: int) -> dict[str, object]:
    port, folders = free_port(), run_folders()
    args = ("--preset", "tiny", "--threads", "1", "--port", str(port))
    with ServerProcess(*args, timeout_s=START_TIMEOUT_S) as url:  # one process: its sockets lack SO_REUSEPORT
        busy(url, busy_requests)
    waiting = time_wait(port)
    said, status = start(*args, "--frontends", "2")
    return {
        f"restart --frontends 2: sockets in TIME-WAIT on its port after {busy_requests} requests": waiting,
        "restart --frontends 2: the second start": said if status is None else f"exit {status}: {said}",
        "restart --frontends 2: run folders left": len(run_folders() - folders),
    }


def held_port() -> dict[str, object]:
    out: dict[str, object] = {}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        for extra in ((), ("--frontends", "2")):
            folders = run_folders()
            said, status = start("--preset", "tiny", "--threads", "1", "--port", str(port), *extra)
            which = " ".join(("serve", *extra))
            out[f"held port: {which}"] = said if status is None else f"exit {status}: {said}"
            out[f"held port: {which}: run folders left"] = len(run_folders() - folders)
    return out


def cluster_status(port: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "cluster", "status", "--port", str(port), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr.strip()}


async def spoofed(url: str, forwarded: list[str | None]) -> str:
    """What conversations opened on `url` together, one per entry of `forwarded` (an `X-Forwarded-For`, or None),
    got: how many opened, and the rest's answers."""
    held, got = [], Counter()
    for address in forwarded:
        headers = {"X-Forwarded-For": address} if address else {}
        try:
            ws = await connect(f"{url}/api/chat?mode=turn&codec=pcm16", additional_headers=headers)
        except InvalidStatus as e:
            got[f"HTTP {e.response.status_code} {refusal_of(e)!r}"] += 1
            continue
        except OSError as e:
            got[str(e)] += 1
            continue
        held.append(ws)
        heard = Listener(ws)
        got["opened" if await heard.until(lambda heard=heard: heard.opened, 10.0) else heard.said()] += 1
    for ws in held:
        await ws.close()
    return "; ".join(f"{n} x {o}" for o, n in got.most_common())


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def cluster(settle_s: float = 15.0) -> dict[str, object]:
    """`s2s cluster --replicas 1` with a per-client limit of 1: a local process's spoofed `X-Forwarded-For` straight
    to the replica; then SIGKILL of the cluster, what it left, and a second cluster on its port."""
    port = free_port()
    args = ("--replicas", "1", "--port", str(port), "--preset", "tiny", "--threads", "1")
    args += ("--max-conversations-per-client", "1", "--admission-headroom", "1000")  # the limit, not the cost model
    out: dict[str, object] = {}
    first = ServerProcess(*args, subcommand="cluster", timeout_s=START_TIMEOUT_S)
    with first:
        replica = cluster_status(port).get("replicas", [{}])[0]
        if replica.get("port"):
            forwarded = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", None]
            got = asyncio.run(spoofed(f"ws://127.0.0.1:{replica['port']}", forwarded))
            out["cluster: straight at the replica, 4 spoofed + 1 plain, limit 1"] = got
        else:
            out["cluster: straight at the replica, 4 spoofed + 1 plain, limit 1"] = f"no TCP port to reach ({replica})"
        children = descendants(first.proc.pid)
        ports = [port, *(r["port"] for r in cluster_status(port).get("replicas", []) if r.get("port"))]
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        deadline = time.monotonic() + settle_s
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = alive(children)
        out[f"cluster SIGKILL: its processes alive {settle_s:.0f} s after"] = f"{len(left)} of {len(children)}"
        out["cluster SIGKILL: ports still listening"] = sum(listening(p) for p in ports)
        second = ServerProcess(*args, subcommand="cluster", timeout_s=START_TIMEOUT_S)
        try:
            with second:
                said = "serving" + (f", beside {len(alive(left))} orphans" if alive(left) else "")
        except RuntimeError:
            lines = [line.strip() for line in second.output.splitlines() if line.strip()]
            said = f"exit {second.proc.returncode}: {lines[-1] if lines else '(no output)'}"
        out["cluster SIGKILL: a second cluster on its port"] = said
        for pid in alive(left):
            os.kill(pid, signal.SIGKILL)
    return out


def operators(quick: bool) -> dict[str, object]:
    """Each probe's servers get a temporary folder of their own (`TMPDIR`), so that what they leave is told apart
    from what other processes on the machine make."""
    before = os.environ.get("TMPDIR")
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        os.environ["TMPDIR"] = tmp
        try:
            return {**restart(500 if quick else 5000), **held_port(), **cluster()}
        finally:
            if before is None:
                del os.environ["TMPDIR"]
            else:
                os.environ["TMPDIR"] = before
