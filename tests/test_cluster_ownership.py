"""`s2s cluster` owns its children: a replica believes X-Forwarded-For only from HAProxy (on the Unix socket in the
run folder by which HAProxy reaches it, never on its port), SIGKILL of `s2s cluster` leaves no process and no port
behind, and a new cluster cleans up what a killed one left or refuses to start beside it.

The first two tests share one cluster, in file order: the second kills it."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
from tests_support import wait_until
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from server.cluster.control import ask
from server.moshi.protocol import Kind
from server.ports import free_port
from server.process import ServerProcess

pytestmark = [
    pytest.mark.paced,  # a cluster of processes: alone and last (tests/conftest.py)
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (scripts/setup.sh does)"),
]


def cluster_args(port: int, run_dir: Path) -> list[str]:
    """One `tiny` replica, one conversation per client (and the engine admits whatever the machine's load)."""
    args = ["--replicas", "1", "--port", str(port), "--run-dir", str(run_dir), "--max-replicas", "2"]
    args += ["--preset", "tiny", "--threads", "1", "--admission-headroom", "1000"]
    return args + ["--max-conversations-per-client", "1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running cluster: (its ws:// URL, its run folder, its process)."""
    run_dir = tmp_path_factory.mktemp("owned") / "run"
    process = ServerProcess(*cluster_args(free_port(), run_dir), subcommand="cluster", timeout_s=240)
    with process as url:
        yield url, run_dir, process


def status(run_dir: Path) -> dict:
    return list(ask(run_dir / "control.sock", {"command": "status"}))[-1]["result"]


def descendants(pid: int) -> set[int]:
    """Every process under `pid` (HAProxy, the replicas and theirs), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError):
                pass  # it went meanwhile
    found, todo = set(), [pid]
    while todo:
        pid = todo.pop()
        children = {child for child, parent in parents.items() if parent == pid}
        found |= children
        todo += children
    return found


def alive(pid: int) -> bool:
    """Running (a zombie is not: whoever adopted it may not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def kill_all(pids: set[int]) -> None:
    """What a failed test left, so that no process outlives it."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def left_behind(pids: set[int], ports: list[int]) -> str:
    return f"alive: {sorted(p for p in pids if alive(p))}; listening: {[p for p in ports if listening(p)]}"


async def opened(url: str, forged: str | None = None, source: str = "127.0.0.1") -> ClientConnection:
    """A conversation from `source`, whose request says `X-Forwarded-For: forged`, once the server holds it."""
    headers = {"X-Forwarded-For": forged} if forged else {}
    ws = await connect(f"{url}/api/chat?mode=turn&codec=pcm16", additional_headers=headers, local_addr=(source, 0))
    async for message in ws:
        if message[0] == Kind.METADATA:
            return ws
    raise AssertionError("closed before the metadata")


async def refused(url: str, forged: str | None = None, source: str = "127.0.0.1") -> int:
    """The HTTP status a conversation gets (101: opened, then closed here)."""
    try:
        ws = await opened(url, forged, source)
    except InvalidStatus as e:
        return e.response.status_code
    await ws.close()
    return 101


def test_a_forged_x_forwarded_for_is_believed_only_from_haproxy(cluster) -> None:
    """One conversation per client. Straight to the replica's port, a second conversation is refused whatever
    address its X-Forwarded-For names (every local process is 127.0.0.1 there). Through HAProxy, another client
    (127.0.0.2) is served beside it, and neither client gets a second by naming another address."""
    url, run_dir, _ = cluster
    direct = f"ws://127.0.0.1:{status(run_dir)['replicas'][0]['port']}"

    async def body() -> list[int]:
        held = [await opened(direct, forged="10.0.0.1")]
        answers = [await refused(direct, forged="10.0.0.2"), await refused(direct)]
        held.append(await opened(url, forged="10.0.0.3", source="127.0.0.2"))
        answers += [await refused(url, forged="10.0.0.4"), await refused(url, forged="10.0.0.5", source="127.0.0.2")]
        for ws in held:
            await ws.close()
        return answers

    assert asyncio.run(body()) == [429] * 4


def test_sigkill_of_the_cluster_leaves_no_process_and_no_port_behind(cluster) -> None:
    """HAProxy and the replica end with `s2s cluster`, and every port they listened on is free."""
    url, run_dir, process = cluster
    now = status(run_dir)
    ports = [int(url.rsplit(":", 1)[1]), now["stats_port"], *(r["port"] for r in now["replicas"])]
    pids = descendants(process.proc.pid)
    assert len(pids) >= 2 and all(map(listening, ports)), (pids, ports)
    process.proc.kill()
    process.proc.wait()
    try:
        wait_until(
            lambda: not any(map(alive, pids)) and not any(map(listening, ports)),
            30,
            lambda: left_behind(pids, ports),
        )
    finally:
        kill_all(pids)


def test_a_new_cluster_after_a_killed_one_cleans_up_or_refuses(tmp_path: Path) -> None:
    """A cluster started on a SIGKILLed one's port and run folder at once either refuses, saying why (and starts
    once the old one's processes are gone), or serves with none of them left; its control socket answers."""
    port, run_dir = free_port(), tmp_path / "run"
    first = ServerProcess(*cluster_args(port, run_dir), subcommand="cluster", timeout_s=240)
    first.__enter__()
    pids = descendants(first.proc.pid)
    try:
        first.proc.kill()
        first.proc.wait()
        second = ServerProcess(*cluster_args(port, run_dir), subcommand="cluster", timeout_s=240)
        try:
            try:
                second.__enter__()
            except RuntimeError as e:
                said = str(e)
                assert "serving" not in said and ("still runs" in said or "the port is in use" in said), said
                assert second.proc.returncode != 0
                wait_until(lambda: not any(map(alive, pids)), 30, lambda: left_behind(pids, [port]))
                second = ServerProcess(*cluster_args(port, run_dir), subcommand="cluster", timeout_s=240)
                second.__enter__()
            assert not any(map(alive, pids)), left_behind(pids, [])
            assert [r["state"] for r in status(run_dir)["replicas"]] == ["UP"]
        finally:
            second.__exit__()
    finally:
        first.__exit__()
        kill_all(pids)


def test_a_port_another_process_listens_on_refuses_the_start(tmp_path: Path) -> None:
    """A listener with SO_REUSEPORT, as an orphaned HAProxy's: the cluster exits non-zero, saying so, before it
    starts any replica (HAProxy would share the port with it, and the cluster say it serves)."""
    run_dir = tmp_path / "run"
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        process = ServerProcess(*cluster_args(port, run_dir), subcommand="cluster", timeout_s=240)
        with pytest.raises(RuntimeError) as refused:
            with process:
                pass
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in str(refused.value), refused.value
    assert process.proc.returncode != 0 and not (run_dir / "r1.log").exists()


def test_a_socket_in_the_run_folder_that_answers_refuses_the_start(tmp_path: Path) -> None:
    """An orphaned HAProxy's admin socket still answers in the run folder: the cluster exits non-zero, saying so,
    before it starts any replica."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as orphan:
        orphan.bind(str(run_dir / "haproxy.sock"))
        orphan.listen()
        process = ServerProcess(*cluster_args(free_port(), run_dir), subcommand="cluster", timeout_s=240)
        with pytest.raises(RuntimeError) as refused:
            with process:
                pass
    assert f"a cluster still runs from {run_dir} (haproxy.sock answers)" in str(refused.value), refused.value
    assert process.proc.returncode != 0 and not (run_dir / "r1.log").exists()
