"""Issue 45: a Realtime client's events cost the server what they are. Flipping the VAD setting beside a healthy
duplex conversation costs it nothing; costlier events count as several messages of the pace, a new voice at most
once a second; a client that leaves has what it had queued dropped, not worked through."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_server import SERVE_ARGS, metric, metrics_when, run_with_server, speech
from tests_support import snapshot_until, spy_pushes, wait_until
from websockets.asyncio.client import connect

from server.app import ServerOptions
from server.connection import Limits
from server.process import ServerProcess

pytestmark = pytest.mark.paced  # servers at real time: alone and last (tests/conftest.py)

APPEND = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(480)).decode()})


async def errors_until(ws, code: str, timeout: float = 10) -> list[dict]:
    """The error events until one with `code` (included)."""
    errors = []
    async with asyncio.timeout(timeout):
        while not errors or errors[-1]["code"] != code:
            if (event := json.loads(await ws.recv()))["type"] == "error":
                errors.append(event["error"])
    return errors


def test_a_vad_setting_flood_beside_a_healthy_duplex_conversation(tmp_path) -> None:
    """A Realtime client flips its server_vad setting 50 times a second between 480-byte appends, inside the message
    bound, while a duplex conversation streams 6 s in real time: every update is answered, and the healthy client
    gets all its audio back with no deadline miss (each new setting made an endpointer, loading Silero: 40 ms of CPU
    each, which left it 4 % of its audio). Server, healthy client and flipper are three processes, the flipper
    niced: its own CPU stands in for another machine's."""
    from codec.pcm import save_wav

    wav = tmp_path / "healthy.wav"
    save_wav(wav, speech(6.0))
    args = ["--wav", str(wav), "--out", str(tmp_path / "reply.wav"), "--mode", "duplex", "--codec", "pcm16"]
    with ServerProcess(*SERVE_ARGS) as url:
        healthy = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "client", url, *args, "--listen", "0.5"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        flipper = subprocess.run(
            ["nice", "-n", "19", sys.executable, str(Path(__file__).with_name("vad_flip_client.py")), url, "6"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        said = healthy.communicate(timeout=60)[0]
        assert flipper.returncode == 0 and "errors: []" in flipper.stdout, flipper.stdout + flipper.stderr
        assert healthy.returncode == 0 and "server error" not in said, said
        assert float(said.split("got ")[1].split(" s")[0]) >= 5.9, said
        text = wait_until(
            lambda: asyncio.run(metrics_when(url, lambda text: metric(text, "s2s_conversations") == 0)),
            what="the clients' conversations were not closed",
        )
        assert metric(text, "s2s_deadline_misses_total") == 0, "the healthy conversation missed deadlines"


def test_a_client_that_leaves_has_its_backlog_dropped(parts) -> None:
    """A Realtime client sends 400 appends at once, far past a pace of 10 messages a second, and closes its socket:
    its conversation ends at once, what it had queued unread. Counted, not timed: by the time the conversation is
    closed the engine got the burst the pace let through and what came in the few seconds after at most, not the
    backlog (the server noticed a client gone only behind its messages, or at its keepalive ping 20 s on)."""
    rate, sent = 10, 400

    async def body(url, server):
        pushed = spy_pushes(server.engine)
        ws = await connect(f"{url}/v1/realtime?model=s2s")
        await ws.recv()  # session.created
        await snapshot_until(server.engine, lambda s: s.conversations == 1, what="the conversation did not open")
        for _ in range(sent):
            await ws.send(APPEND)
        ws.transport.abort()
        await snapshot_until(server.engine, lambda s: s.conversations == 0, 60, "the conversation outlived its client")
        return len(pushed)

    pushed = run_with_server(parts, body, ServerOptions(port=0, limits=Limits(max_messages_per_s=rate)))
    assert pushed <= rate + 5 * rate, (
        f"{pushed} of the {sent} appends reached the engine: the backlog was worked through"
    )


def test_costly_events_count_as_several_messages(parts) -> None:
    """At 20 messages a second, five session.updates and a deletion (10: the engine computes the conversation after
    an edit again) fit the burst; two more deletions do not, failing or not: they are throttled and told."""

    async def body(url, server):
        async with connect(f"{url}/v1/realtime?model=s2s") as ws:
            await ws.recv()  # session.created
            for _ in range(5):
                await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
            for _ in range(3):
                await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": "item_none"}))
            errors = await errors_until(ws, "throttled")
            assert {e["code"] for e in errors[:-1]} <= {"item_not_found"}, errors
            assert "messages a second" in errors[-1]["message"]

    run_with_server(parts, body, ServerOptions(port=0, limits=Limits(max_messages_per_s=20)))


def test_a_new_voice_at_most_once_a_second(parts) -> None:
    """Each new voice opens a new conversation in the engine: a second one within a second is refused and told."""
    cfg = parts[0].config
    rng = np.random.default_rng(0)
    voices = {name: rng.integers(0, cfg.codebook_size, (cfg.num_codebooks, 20)) for name in ("alice", "bob")}

    def voice(name: str) -> str:
        session = {"type": "realtime", "audio": {"output": {"voice": name}}}
        return json.dumps({"type": "session.update", "session": session})

    async def body(url, server):
        async with connect(f"{url}/v1/realtime?model=s2s") as ws:
            await ws.recv()  # session.created
            await ws.send(voice("alice"))
            await ws.send(voice("bob"))
            (error,) = await errors_until(ws, "rate_limited")
            assert "once a second" in error["message"]
            await asyncio.sleep(1.0)
            await ws.send(voice("bob"))
            async with asyncio.timeout(10):
                while (event := json.loads(await ws.recv()))["type"] != "session.updated" or "bob" not in str(event):
                    assert event["type"] != "error", event

    run_with_server(parts, body, voices=voices)
