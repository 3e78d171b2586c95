"""`s2s serve --frontends N`: the websocket endpoints in N processes on one port, one engine behind them
(server/frontends/processes.py, server/frontends/engine_core.py, server/frontends/engine_client.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from test_server import metric, speech
from tests_support import wait_until
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from s2s import Engine, EngineConfig, ModelConfig, Refused, S2SModel
from s2s.engine.events import MetaEvent
from s2s.models.shipped import shipped
from server.cli.options import default_threads
from server.connection import PerClient
from server.frontends.engine_client import CoreClients, EngineClient
from server.frontends.engine_core import EngineCore
from server.moshi.client import refusal_of, talk
from server.moshi.protocol import Kind
from server.process import ServerProcess

TINY = ["--preset", "tiny", "--codec", str(shipped("codec")), "--threads", "1", "--admission-headroom", "inf"]


def get(url: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url.replace("ws://", "http://") + path, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def every_frontend(url: str, path: str, tries: int = 12) -> list[tuple[int, str]]:
    """`path` asked on `tries` new connections: the kernel spreads them over the front ends by hash."""
    return [get(url, path) for _ in range(tries)]


def all_show(url: str, name: str, value: float) -> bool:
    """Whether every front end's /metrics (as many as `every_frontend` reaches) shows `name` at `value`."""
    return all(status == 200 and metric(text, name) == value for status, text in every_frontend(url, "/metrics"))


@pytest.mark.paced  # at real time: alone and last (tests/conftest.py)
def test_conversations_through_two_front_ends_are_heard_and_counted_once() -> None:
    """A held-out sentence in turn mode (pcm16) and in duplex (Ogg/Opus) through `--frontends 2` on the shipped echo
    model: the recogniser hears it in each reply, as in one process (`s2s demo`). Every front end's /metrics shows
    the same figures: the engine's, and the front ends' own counters summed."""
    from speech import oracle
    from speech.voices import HELDOUT_VOICES, say

    sentence = "the train leaves at seven tonight"
    question = say(sentence, HELDOUT_VOICES[0])
    serve = ["--frontends", "2", "--threads", "1", "--jitter-buffer-ms", "1000", "--admission-headroom", "inf"]
    with ServerProcess(*serve) as url:

        async def conversations():
            turn = await talk(url, question, mode="turn", codec="pcm16", listen_s=15.0, seed="1")
            duplex = await talk(url, question, mode="duplex", codec="opus", listen_s=1.0, seed="2")
            more = await asyncio.gather(*(talk(url, speech(0.5), mode="duplex", codec="pcm16") for _ in range(4)))
            return turn, duplex, more

        turn, duplex, more = asyncio.run(conversations())
        hear = oracle.recognizer()
        for reply in (turn, duplex):
            assert reply.handshake and not reply.errors, reply.errors
            assert hear.transcribe(reply.reply) == sentence
        assert turn.turn_latency_s is not None
        assert all(r.handshake and not r.errors and len(r.reply) >= 0.4 * 24000 for r in more)
        # the last close reaches the engine a moment after the client's, and every front end's snapshot (the core
        # sends one every 0.1 s) a moment after that
        wait_until(lambda: all_show(url, "s2s_conversations", 0), 30, "a front end still shows a conversation")
        for status, text in every_frontend(url, "/metrics"):
            assert status == 200
            assert metric(text, "s2s_connections_total", 'protocol="moshi"') == 6
            assert metric(text, "s2s_turn_stage_seconds_count", 'protocol="moshi",stage="turn_latency"') == 1
            assert metric(text, "s2s_conversations") == 0 and metric(text, "s2s_kv_pages", 'state="private"') == 0


@pytest.mark.paced  # at real time: alone and last (tests/conftest.py)
def test_admission_and_the_per_client_limit_hold_across_front_ends() -> None:
    """The engine's maximum and one client's limit are the whole server's, whichever front end a connection
    reaches. With a maximum of 3 and a per-client limit of 2 (clients told apart by X-Forwarded-For from a trusted
    proxy): a client's third is refused (429) while its two are open; a second client's one makes 3, and a third
    client is refused (503), counted once; once the first client's two close, it is served again."""
    chat = "/api/chat?mode=duplex&codec=pcm16"

    def as_client(ip: str) -> dict:
        return {"additional_headers": {"X-Forwarded-For": ip}}

    async def hold(url: str, ip: str, n: int, stop: asyncio.Event) -> list:
        opened, ready = [], asyncio.Event()

        async def one():
            async with connect(url + chat, **as_client(ip)) as ws:
                await ws.recv()  # the handshake, sent before the session opens
                assert (await ws.recv())[0] == Kind.METADATA  # open: the engine holds it
                opened.append(ws)
                if len(opened) == n:
                    ready.set()
                await stop.wait()

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        waiting = asyncio.create_task(ready.wait())
        await asyncio.wait([waiting, *tasks], timeout=60, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        for task in tasks:
            if task.done():
                task.result()  # a refused connection raises its InvalidStatus here
        assert ready.is_set(), f"{ip}'s {n} conversations did not open in 60 s"
        return tasks

    async def refusal(url: str, ip: str) -> str:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(url + chat, **as_client(ip)):
                pass
        return f"{refused.value.response.status_code} {refusal_of(refused.value)}"

    async def scenario(url: str) -> tuple[str, str]:
        first, second = asyncio.Event(), asyncio.Event()
        held = await hold(url, "10.0.0.1", 2, first)
        try:
            per_client = await refusal(url, "10.0.0.1")
            held += await hold(url, "10.0.0.2", 1, second)
            engine_full = await refusal(url, "10.0.0.3")
        finally:
            first.set()
            second.set()
            await asyncio.gather(*held)
        return per_client, engine_full

    limits = ["--max-conversations", "3", "--max-conversations-per-client", "2", "--forwarded-allow-ips", "127.0.0.1"]
    with ServerProcess(*TINY, "--frontends", "2", *limits) as url:
        per_client, engine_full = asyncio.run(scenario(url))
        assert per_client.startswith("429 refused: this client has 2 conversations open"), per_client
        assert engine_full.startswith("503 refused: the engine holds its maximum of 3"), engine_full
        # every front end gets a snapshot newer than the refusal (the core sends one every 0.1 s): counted once
        refusals = lambda: {metric(text, "s2s_refused_total") for _, text in every_frontend(url, "/metrics")}  # noqa: E731
        wait_until(lambda: min(refusals()) >= 1, 30, lambda: f"a front end does not count the refusal: {refusals()}")
        assert refusals() == {1}

        async def again() -> None:  # the first client's two were given back (`hold` raises a refusal)
            stop = asyncio.Event()
            tasks = await hold(url, "10.0.0.1", 2, stop)
            stop.set()
            await asyncio.gather(*tasks)

        asyncio.run(again())


@pytest.mark.paced  # at real time: alone and last (tests/conftest.py)
def test_sigusr1_drains_every_front_end_and_a_dead_front_end_stops_the_server() -> None:
    server = ServerProcess(*TINY, "--frontends", "2")
    with server as url:
        assert {status for status, _ in every_frontend(url, "/healthz")} == {200}
        server.proc.send_signal(signal.SIGUSR1)
        wait_until(
            lambda: {status for status, _ in every_frontend(url, "/healthz")} == {503},
            30,
            lambda: f"not every front end drains: {every_frontend(url, '/healthz')}",
        )
        frontend = next(line for line in server.output.splitlines() if "front-end processes" in line)
        children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
        spawned = [pid for pid in children if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
        assert len(spawned) == 2, (frontend, children)
        subprocess.run(["kill", "-9", spawned[0]], check=True)
        assert server.proc.wait(30) == 1, server.output
        assert "exited: stopping the server" in server.output


@contextlib.contextmanager
def running_core():
    """An engine (tiny, codec-free) behind its core in a thread, and a front end's client to it in this thread."""
    model = S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=2), seed=0)
    engine = Engine(model, None, EngineConfig(calibration_ticks=0, num_pages=256, max_conversations=4))
    engine.add_voice("narrator", np.zeros((2, 16), dtype=np.int64))
    address = f"ipc:///tmp/s2s-test-core-{id(engine)}"
    core = EngineCore(engine, address, PerClient(1))
    stop = threading.Event()
    thread = threading.Thread(target=core.run, args=(stop.is_set,), daemon=True)
    engine.start()
    thread.start()
    try:
        yield engine, EngineClient(address, b"frontend-0"), address
    finally:
        stop.set()
        thread.join()
        engine.stop()


def test_the_client_raises_in_the_caller_what_the_engine_would() -> None:
    """What `Engine` raises in the caller's thread, the front end's client raises in its own: an unknown voice, a
    turn-mode call on a duplex conversation, samples out of range, a closed conversation, a refusal."""
    with running_core() as (engine, client, _):
        assert client.voices == {"narrator"} and client.model.config.num_codebooks == 2
        engine.add_voice("guide", np.zeros((2, 16), dtype=np.int64))  # while it serves
        assert client.voices == {"narrator", "guide"}
        with pytest.raises(KeyError, match="no voice prompt named 'nobody'"):
            client.open("duplex", prompt="nobody")
        cid = client.open("duplex", prompt="narrator")
        with pytest.raises(ValueError, match="end_turn is for turn mode"):
            client.end_turn(cid)
        with pytest.raises(ValueError, match="codes must lie in"):
            client.push_codes(cid, np.full((2, 4), 5000))
        with pytest.raises(ValueError, match="no codec"):
            client.push_audio(cid, np.zeros(1920, dtype=np.float32))
        clients = CoreClients(client, 1)
        clients.take("10.0.0.1")
        assert (
            client.query("client_problem", "10.0.0.1")
            == "this client has 1 conversations open, the most one client may"
        )
        with pytest.raises(Refused, match="this client has 1"):
            clients.take("10.0.0.1")
        clients.give_back("10.0.0.1")
        assert clients.problem("10.0.0.1") is None
        client.close(cid)
        with pytest.raises(KeyError, match="no open session"):
            client.pause(cid)


def test_events_reach_the_front_end_that_opened_the_conversation_and_no_other() -> None:
    """Codes pushed through one front end's client come back to it as the engine's events, ended by None; a second
    front end cannot touch a conversation it does not hold (its command is ignored, the conversation goes on)."""

    async def main(engine, client, address):
        client.start()
        other = EngineClient(address, b"frontend-1")
        cid = client.open("duplex")
        other._modes[cid] = "duplex"  # as if it held it: the core still knows better
        other.close(cid)
        client.push_codes(cid, np.full((2, 40), 7))
        q, codes = client.event_queue(cid), 0
        while codes < 30:  # the events, as they come
            event = await asyncio.to_thread(q.get, timeout=30)  # (`queue.Empty` after 30 s without one)
            assert event is not None, "closed by a front end that does not hold it"
            codes += 0 if isinstance(event, MetaEvent) else event.codes.shape[-1]
        client.close(cid)
        while (event := await asyncio.to_thread(q.get, timeout=10)) is not None:
            pass

    with running_core() as (engine, client, address):
        asyncio.run(main(engine, client, address))


def test_serve_refuses_a_negative_front_end_count() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--frontends", "-1"], capture_output=True, text=True
    )
    assert out.returncode != 0 and "--frontends must be 0 or more" in out.stderr


@pytest.mark.parametrize(("cores", "frontends", "threads"), [(2, 0, 1), (1, 0, 1), (16, 0, 15), (16, 2, 14), (2, 4, 1)])
def test_the_engine_s_torch_threads_leave_the_front_ends_and_the_event_loop_their_cores(
    monkeypatch, cores: int, frontends: int, threads: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert default_threads(frontends) == threads


def test_a_front_end_imports_neither_the_engine_nor_the_codec() -> None:
    """A front end moves audio and events: importing what it runs (`run_frontend`'s module, as `spawn` does) leaves
    out the engine, the model, the codec and transformers, which would cost it seconds to start and ~200 MB each."""
    heavy = ["s2s.engine.engine", "s2s.models.model", "codec.tokenizer", "codec.streaming", "transformers"]
    imports = (  # spawn's main, then ours
        "import server.cli.main, server.frontends.processes, server.gc_pause, server.frontends.engine_client"
    )
    check = f"import sys; {imports}; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_lazy_packages_name_every_export() -> None:
    """`s2s` and `codec` resolve each name of their `__all__` on first use, and name no other."""
    import codec
    import s2s

    for package, eager in ((s2s, {"placement"}), (codec, set())):
        assert set(package.__all__) == set(package._HOMES) | eager
        for name in package.__all__:
            value = getattr(package, name)
            assert getattr(value, "__name__", name) == name  # (values without a name: BANDWIDTHS, the Tokenizer alias)
        with pytest.raises(AttributeError, match="no attribute 'nothing'"):
            package.nothing  # noqa: B018
