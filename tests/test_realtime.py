"""server/realtime/: OpenAI's Realtime API at /v1/realtime, driven by the official `openai` SDK (GA and beta) and by
raw websockets for what an SDK would not send."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from openai import AsyncOpenAI
from test_server import http_get, metric, run_with_server, speech
from tests_support import engine_read_async, engine_until
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from codec.pcm import to_pcm16
from server.app import ServerOptions
from server.moshi import protocol
from server.moshi.client import refusal_of
from server.moshi.protocol import Kind

pytestmark = pytest.mark.paced  # servers at real time: alone and last (tests/conftest.py)

TOKEN = "secret-token"
OPTIONS = ServerOptions(port=0, token=TOKEN)


def b64(pcm: np.ndarray) -> str:
    return base64.b64encode(to_pcm16(pcm)).decode()


def the_session(engine):
    """The engine's one conversation: only on the engine thread (`tests_support.engine_read_async`)."""
    (s,) = engine.sessions.values()
    return s


def client(url: str) -> AsyncOpenAI:
    """`websocket_base_url` for the beta client, which otherwise always dials wss://."""
    return AsyncOpenAI(base_url=url.replace("ws://", "http://") + "/v1", websocket_base_url=url + "/v1", api_key=TOKEN)


async def until(conn, kind: str, seen: list | None = None, timeout: float = 30):
    """Events until one of type `kind` (returned); the others go to `seen`."""
    async with asyncio.timeout(timeout):
        while True:
            event = await conn.recv()
            if event.type == kind:
                return event
            if seen is not None:
                seen.append(event)


async def append(conn, pcm: np.ndarray, real_time: bool = False) -> None:
    """In 100 ms chunks, as the SDK's examples send them."""
    for a in range(0, len(pcm), 2400):
        await conn.send({"type": "input_audio_buffer.append", "audio": b64(pcm[a : a + 2400])})
        if real_time:
            await asyncio.sleep(0.1)


async def ask(conn, seconds: float = 0.6, seed: int = 0, response: dict | None = None) -> None:
    """Append speech, commit it, ask for a response (`response`: its parameters)."""
    await append(conn, speech(seconds, seed))
    await conn.send({"type": "input_audio_buffer.commit"})
    await conn.send({"type": "response.create", **({"response": response} if response else {})})


async def manual_turn(conn, seconds: float = 0.6, seed: int = 0) -> list:
    """`ask`; the events up to `response.done` (included)."""
    await ask(conn, seconds, seed)
    seen: list = []
    seen.append(await until(conn, "response.done", seen))
    return seen


async def manual(conn) -> None:
    """Manual turns, and a seeded draw: a reply's length (where it samples its END code) is the same every run."""
    await until(conn, "session.created")
    session = {"type": "realtime", "audio": {"input": {"turn_detection": None}}, "seed": 0}
    await conn.send({"type": "session.update", "session": session})
    updated = await until(conn, "session.updated")
    assert updated.session.audio.input.turn_detection is None


def test_a_turn_with_server_vad_through_the_sdk(parts) -> None:
    """Speech appended in real time; the server's VAD ends the turn, and the reply's audio comes until response.done."""
    from speech.sample import synthesize

    question = np.concatenate([synthesize("Good morning, can you hear me?"), np.zeros(24000, np.float32)])

    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            created = await until(conn, "session.created")
            assert created.session.audio.input.turn_detection.type == "server_vad"
            assert created.session.audio.output.format.rate == 24000
            vad = {"type": "server_vad", "silence_duration_ms": 400, "create_response": True}
            await conn.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": vad}}}})
            assert (await until(conn, "session.updated")).session.audio.input.turn_detection.silence_duration_ms == 400
            sender = asyncio.create_task(append(conn, question, real_time=True))
            seen: list = []
            done = await until(conn, "response.done", seen)
            await sender
        kinds = [e.type for e in seen]
        order = [
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
            "conversation.item.added",
            "response.created",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_audio.delta",
            "response.output_audio.done",
            "response.content_part.done",
            "response.output_item.done",
        ]
        once = set(order) - {"conversation.item.added", "response.output_audio.delta"}  # (user and reply items)
        assert all(kinds.count(k) == 1 for k in once), " ".join(k for k in kinds if "delta" not in k)
        firsts = [kinds.index(k) for k in order]
        assert firsts == sorted(firsts), kinds
        deltas = [e for e in seen if e.type == "response.output_audio.delta"]
        audio = b"".join(base64.b64decode(e.delta) for e in deltas)
        assert done.response.status in ("completed", "incomplete") and len(audio) >= 2 * 320
        assert {e.response_id for e in deltas} == {done.response.id}
        assert done.response.output[0].id == deltas[0].item_id
        text = await http_get(url + "/metrics")
        assert metric(text, "s2s_turn_stage_seconds_count", 'protocol="realtime",stage="turn_latency"') == 1
        assert metric(text, "s2s_connections_total", 'protocol="realtime"') == 1

    run_with_server(parts, body, OPTIONS, max_reply_frames=30)


def test_manual_commit_and_response_create(parts) -> None:
    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await manual(conn)
            seen = await manual_turn(conn)
            committed = next(e for e in seen if e.type == "input_audio_buffer.committed")
            user = next(e for e in seen if e.type == "conversation.item.added" and e.item.role == "user")
            assert user.item.id == committed.item_id and user.item.content[0].type == "input_audio"
            assert seen[-1].response.status in ("completed", "incomplete")
            assert any(e.type == "response.output_audio.delta" for e in seen)
            seen = await manual_turn(conn, seed=1)  # a second turn: its own items
            second = next(e for e in seen if e.type == "input_audio_buffer.committed")
            assert second.previous_item_id not in (None, committed.item_id)  # the first response's item is between
            turns = await engine_read_async(
                server.engine,
                lambda: [(t.committed, t.reply_end is not None) for t in the_session(server.engine).turns],
            )
        assert turns == [(True, True), (True, True)], turns

    run_with_server(parts, body, OPTIONS, max_reply_frames=20)


def test_truncate_mid_reply_keeps_only_what_was_played_in_the_next_turns_context(parts) -> None:
    async def body(url, server):
        engine = server.engine
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await manual(conn)
            await ask(conn)
            received, item = 0, None
            async with asyncio.timeout(30):
                while received < 24000 * 0.4:
                    event = await conn.recv()
                    if event.type == "response.output_audio.delta":
                        received += len(base64.b64decode(event.delta)) // 2
                        item = event.item_id
            played_ms = 200
            played = played_ms * 24000 // 1000 // 320  # frames

            def playing() -> tuple[int, np.ndarray]:  # on the engine thread
                turn = the_session(engine).turns[0]
                return turn.reply_start, the_session(engine).model[turn.reply_start : turn.reply_start + played].copy()

            reply_start, kept = await engine_read_async(engine, playing)
            await conn.send(
                {"type": "conversation.item.truncate", "item_id": item, "content_index": 0, "audio_end_ms": 10**6}
            )
            error = await until(conn, "error")
            assert error.error.code == "invalid_value" and "past the item's audio" in error.error.message
            await conn.send(
                {"type": "conversation.item.truncate", "item_id": item, "content_index": 0, "audio_end_ms": played_ms}
            )
            seen: list = []
            truncated = await until(conn, "conversation.item.truncated", seen)
            assert truncated.audio_end_ms == played_ms
            done = next(e for e in seen if e.type == "response.done")
            assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"
            await manual_turn(conn, seed=2)  # the next turn
            k = engine.model.config.num_codebooks

            def after() -> tuple:  # on the engine thread
                s = the_session(engine)
                key = s.key(s.computed)  # what the model attended to: the steps it computed
                t0, t1 = s.turns[:2]
                engine.cache.check()
                return (
                    t0.reply_start,
                    t0.reply_end,
                    key[reply_start : reply_start + played, k].copy(),
                    t1.first_frame,
                    t1.reply_end,
                )

            start, end, attended, next_first, next_end = await engine_read_async(engine, after)
            assert start == reply_start and end - start == played
            assert np.array_equal(attended, kept[:, 0])
            assert next_first >= reply_start + played and next_end is not None

    run_with_server(parts, body, OPTIONS, max_reply_frames=400)


def test_response_cancel(parts) -> None:
    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await manual(conn)
            await ask(conn)
            await until(conn, "response.output_audio.delta")
            await conn.send({"type": "response.cancel"})
            done = await until(conn, "response.done")
            assert done.response.status == "cancelled"
            await conn.send({"type": "response.cancel"})
            assert (await until(conn, "error")).error.code == "response_cancel_not_active"
            engine = server.engine
            await engine_until(
                engine,
                lambda: (s := the_session(engine)).phase.value == "listen" and "interrupted" in s.turns[0].times,
                what="the cancelled reply was not interrupted in the engine",
            )
            seen = await manual_turn(conn, seed=3)  # and it goes on
            assert seen[-1].response.status in ("completed", "incomplete")

    run_with_server(parts, body, OPTIONS, max_reply_frames=400)


MALFORMED = [
    ("{not json", "invalid_json"),
    ("[1, 2]", "invalid_event"),
    ('{"type": 7}', "invalid_event"),
    ('{"type": "no.such.event"}', "unknown_event"),
    ('{"type": "input_audio_buffer.append", "audio": "%%%"}', "invalid_audio"),
    ('{"type": "input_audio_buffer.append", "audio": "AAAB"}', "invalid_audio"),  # 3 bytes: not pcm16
    ('{"type": "session.update", "session": {"type": "realtime", "colour": "blue"}}', "invalid_session"),
    ('{"type": "input_audio_buffer.commit"}', "input_audio_buffer_commit_empty"),
    ('{"type": "conversation.item.delete", "item_id": "item_nope"}', "item_not_found"),
    ('{"type": "conversation.item.create", "item": {"type": "message"}}', "unsupported_event"),
    ('{"type": "conversation.item.delete", "item_id": []}', "item_not_found"),
    ('{"type": "session.update", "session": {"seed": 1.5}}', "invalid_session"),
    ('{"type": "session.update", "session": {"seed": true}}', "invalid_session"),
    ('{"type": "session.update", "session": {"temperature": 1' + "0" * 400 + "}}", "invalid_session"),
    (
        '{"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "server_vad", '
        '"silence_duration_ms": 1' + "0" * 400 + "}}}}}",
        "invalid_session",
    ),
    ('{"type": "session.update", "session": {"temperature": 1' + "0" * 5000 + "}}", "invalid_json"),
    ("[" * 100_000, "invalid_json"),
]


def test_ten_malformed_events_each_get_an_error_and_the_session_goes_on(parts) -> None:
    async def body(url, server):
        async with connect(f"{url}/v1/realtime?model=m", additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            for message, code in MALFORMED:
                await ws.send(message)
                error = json.loads(await ws.recv())
                assert error["type"] == "error" and error["error"]["code"] == code, (message, error)
                assert error["event_id"]
            await ws.send(b"\x01binary")
            assert json.loads(await ws.recv())["error"]["code"] == "invalid_request"
            await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None, "tools": [{}]}}))
            message = json.loads(await ws.recv())["error"]["message"]
            assert "turn_detection: unknown or not supported" in message and "tools: only" in message
            await ws.send(
                json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
            )
            assert json.loads(await ws.recv())["type"] == "session.updated"
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(speech(0.5))}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            kinds = []
            async with asyncio.timeout(30):
                while not kinds or kinds[-1] != "response.done":
                    kinds.append(json.loads(await ws.recv())["type"])
            assert "response.output_audio.delta" in kinds and "error" not in kinds

    run_with_server(parts, body, OPTIONS)


def test_a_response_to_nothing_new_fails_and_edits_wait_for_the_response(parts) -> None:
    """A response whose input made no frame in the engine (less audio than a frame) fails with `no_input`, not a
    hang; deleting an item while a response plays is refused (the engine cannot take it out then)."""

    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await manual(conn)
            await ask(conn)
            user = await until(conn, "input_audio_buffer.committed")
            await until(conn, "response.output_audio.delta")
            await conn.send({"type": "conversation.item.delete", "item_id": user.item_id})
            assert (await until(conn, "error")).error.code == "conversation_already_has_active_response"
            await until(conn, "response.done")
            await conn.send({"type": "input_audio_buffer.append", "audio": b64(speech(0.005))})  # 120 samples
            await conn.send({"type": "response.create"})
            done = await until(conn, "response.done")
            assert done.response.status == "failed" and done.response.status_details.error.code == "no_input"
            seen = await manual_turn(conn, seed=4)  # and it goes on
            assert seen[-1].response.status in ("completed", "incomplete")

    run_with_server(parts, body, OPTIONS)


def test_a_realtime_client_and_a_moshi_client_at_once(parts) -> None:
    async def moshi(url: str) -> int:
        async with connect(f"{url}/api/chat?mode=turn&codec=pcm16&token={TOKEN}") as ws:
            await ws.recv()
            await ws.recv()
            pcm = to_pcm16(speech(0.6, 5))
            for a in range(0, len(pcm), 3840):
                await ws.send(protocol.audio(pcm[a : a + 3840]))
            await ws.send(protocol.control(protocol.Control.END_TURN))
            frames = 0
            async with asyncio.timeout(30):
                while True:
                    message = await ws.recv()
                    if message[0] == Kind.AUDIO:
                        frames += (len(message) - 1) // 640
                    elif message[0] == Kind.METADATA and json.loads(message[1:]).get("event") == "reply_done":
                        return frames

    async def realtime(url: str) -> list:
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await manual(conn)
            return await manual_turn(conn, seed=6)

    async def body(url, server):
        frames, seen = await asyncio.gather(moshi(url), realtime(url))
        assert frames > 0 and any(e.type == "response.output_audio.delta" for e in seen)
        text = await http_get(url + "/metrics")
        for name in ("moshi", "realtime"):
            assert metric(text, "s2s_connections_total", f'protocol="{name}"') == 1
            assert metric(text, "s2s_turn_stage_seconds_count", f'protocol="{name}",stage="turn_latency"') == 1

    run_with_server(parts, body, OPTIONS)


def test_a_beta_client_gets_the_beta_names(parts) -> None:
    async def body(url, server):
        async with client(url).beta.realtime.connect(model="gpt-4o-realtime-preview") as conn:
            created = await until(conn, "session.created")
            assert created.session.input_audio_format == "pcm16" and created.session.turn_detection.type == "server_vad"
            await conn.send(
                {"type": "session.update", "session": {"turn_detection": None, "input_audio_format": "pcm16"}}
            )
            await until(conn, "session.updated")
            seen = await manual_turn(conn)
            kinds = {e.type for e in seen}
            assert {"conversation.item.created", "response.audio.delta", "response.audio.done"} <= kinds
            assert not kinds & {"conversation.item.added", "response.output_audio.delta"}

    run_with_server(parts, body, OPTIONS)


def test_authentication_and_model_name(parts) -> None:
    async def body(url, server):
        bad = AsyncOpenAI(base_url=url.replace("ws://", "http://") + "/v1", api_key="wrong")
        with pytest.raises(Exception, match="401"):
            async with bad.realtime.connect(model="m") as conn:
                await conn.recv()
        async with client(url).realtime.connect(model="other") as conn:
            event = await conn.recv()
            assert event.type == "error" and "this server serves 'ours'" in event.error.message
        async with client(url).realtime.connect(model="ours") as conn:
            assert (await conn.recv()).session.model == "ours"

    run_with_server(parts, body, ServerOptions(port=0, token=TOKEN, served_model_name="ours"))


def test_a_refusal_is_a_503_before_the_upgrade_and_audio_faster_than_real_time_is_throttled(parts) -> None:
    async def body(url, server):
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with connect(f"{url}/v1/realtime", additional_headers=headers) as first:
            assert json.loads(await first.recv())["type"] == "session.created"
            with pytest.raises(InvalidStatus) as second:
                async with connect(f"{url}/v1/realtime", additional_headers=headers):
                    pass
            response = second.value.response
            assert (response.status_code, response.headers.get("Retry-After")) == (503, "1")
            assert refusal_of(second.value) == "refused: the engine holds its maximum of 1 conversations"
            for _ in range(40):  # 4 s of audio at once: past the 2 s burst
                await first.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(speech(0.1))}))
            error = json.loads(await first.recv())
            assert error["error"]["code"] == "throttled" and "faster than real time" in error["error"]["message"]

    run_with_server(parts, body, OPTIONS, max_conversations=1)
