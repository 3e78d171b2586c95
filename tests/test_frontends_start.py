"""Every start of `s2s serve` works or says why: on a port an earlier server left in TIME-WAIT it serves, with
`--frontends` as in one process; on a port something else listens on it exits with one line naming it; a start that
fails leaves no folder, socket or process behind (server/frontends/processes.py, server/app.py, server/cli/serve.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_frontends import TINY, get
from tests_support import wait_until

from s2s import Engine, EngineConfig, ModelConfig, S2SModel
from server.app import ServerOptions
from server.frontends.processes import Frontends
from server.process import ServerProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_by_server(port: int) -> None:
    """A GET /healthz read to its end: the server closes first, so its side of the connection is left in TIME-WAIT."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        while s.recv(4096):
            pass


def time_waits(port: int) -> int:
    """How many sockets on this machine with `port` as their own are in TIME-WAIT (`ss`)."""
    out = subprocess.run(["ss", "-Htan", "state", "time-wait", f"( sport = :{port} )"], capture_output=True, text=True)
    return len(out.stdout.splitlines())


def left_running(tmp: Path) -> dict[int, str]:
    """The processes (but this one) with TMPDIR=`tmp` in their environment, every child of a server started with it
    among them: their command lines by id."""
    mark, found = f"TMPDIR={tmp}".encode(), {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            pid = int(environ.parent.name)
            if pid != os.getpid() and mark in environ.read_bytes().split(b"\0"):
                found[pid] = (environ.parent / "cmdline").read_bytes()[:120].replace(b"\0", b" ").decode()
        except OSError:  # (ended meanwhile, or not ours)
            pass
    return found


def left_behind(tmp: Path) -> list[str]:
    """What servers run with TMPDIR=`tmp` left: their s2s-* folders (the core's ipc socket and the metrics files are
    in them), and their processes."""
    return [*map(str, tmp.glob("s2s-*")), *left_running(tmp).values()]


@pytest.fixture
def servers_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """TMPDIR for the servers a test starts (`tempfile`'s folder in this process too); what they leave running when a
    test fails is killed at its end."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tmp_path
    for pid in left_running(tmp_path):
        os.kill(pid, signal.SIGKILL)


def test_front_ends_start_on_a_port_an_earlier_server_left_in_time_wait(servers_tmp: Path) -> None:
    """A single-process server on a fixed port closes a hundred connections first, then stops; `--frontends 2`
    starts on that port at once, while the server's side of them waits in TIME-WAIT, serves, and leaves nothing
    when it stops. (Before: `[Errno 98] Address already in use` from the port's reservation, and its folder left.)"""
    port = free_port()
    with ServerProcess(*TINY, "--port", str(port)):
        for _ in range(100):
            closed_by_server(port)
    assert time_waits(port) >= 100  # the case under test: the kernel keeps them 60 s
    server = ServerProcess(*TINY, "--frontends", "2", "--port", str(port))
    with server as url:
        assert url == f"ws://127.0.0.1:{port}"
        assert {status for status, _ in (get(url, "/healthz") for _ in range(4))} == {200}
    assert server.proc.returncode == 0, server.output
    wait_until(lambda: not left_behind(servers_tmp), 10, lambda: f"left behind: {left_behind(servers_tmp)}")


@pytest.mark.parametrize("frontends", [[], ["--frontends", "2"]], ids=["one process", "two front ends"])
def test_a_start_on_a_port_something_listens_on_says_so_and_leaves_nothing(servers_tmp: Path, frontends) -> None:
    """The port's listener has SO_REUSEPORT, as another `--frontends` server's front ends of this user have: front
    ends with SO_REUSEPORT could bind beside it and share its connections unseen. The start is refused instead, in
    one line on stderr, with status 1, and leaves no folder or process. (Before: one process exited with a
    traceback; two front ends shared the port.)"""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        serve = [sys.executable, "-m", "server.cli", "serve", *TINY, "--port", str(port), *frontends]
        try:
            out = subprocess.run(serve, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired as e:  # (it served: killed by the timeout)
            raise AssertionError(f"it started on a port something listens on: {e.stdout}") from None
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.splitlines()[-1] == f"s2s serve: cannot listen on 127.0.0.1:{port}: the port is in use"
    assert "Traceback" not in out.stderr, out.stderr
    wait_until(lambda: not left_behind(servers_tmp), 10, lambda: f"left behind: {left_behind(servers_tmp)}")


def test_a_start_that_fails_after_the_front_ends_are_spawned_stops_everything_it_started(servers_tmp: Path) -> None:
    """Front ends that die as they start (here: a certificate file that holds no certificate) fail
    `Frontends.start`, which stops the engine, its core and every front end and removes its folder before it raises.
    (Before: the engine and the core ran on, and the folder stayed.)"""
    bad = servers_tmp / "bad.pem"
    bad.write_text("not a certificate\n")
    model = S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=2), seed=0)
    engine = Engine(model, None, EngineConfig(calibration_ticks=0, num_pages=64, max_conversations=2))
    threads = set(threading.enumerate())
    group = Frontends(engine, ServerOptions(port=0, ssl_certfile=bad, ssl_keyfile=bad), 2)
    try:
        with pytest.raises(RuntimeError, match="exited as it started"):
            group.start()
        assert [c.exitcode is not None for c in group.children] == [True, True]
        assert [t.name for t in threading.enumerate() if t not in threads] == []  # the engine's, the core's
        assert list(servers_tmp.glob("s2s-*")) == []
    finally:
        group.stop()


def test_front_ends_whose_server_is_killed_stop(servers_tmp: Path) -> None:
    """A server killed with SIGKILL cannot stop its front ends: each sees its parent gone and stops, so that none
    serves on alone, holding the port. (Before: they served on.)"""
    server = ServerProcess(*TINY, "--frontends", "2")
    with server as url:
        assert get(url, "/healthz")[0] == 200
        server.proc.kill()
    wait_until(lambda: not left_running(servers_tmp), 30, lambda: f"left running: {left_running(servers_tmp)}")
