"""server/realtime/: the Realtime API's edits to a conversation (barge-in, output clear, item delete, input clear),
response metadata and refusals, and `session.update` (sampling, voice prompts, the beta's fields), each checked in
the engine's own context where it claims to change it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
from dataclasses import dataclass

import numpy as np
import pytest
from test_realtime import OPTIONS, append, ask, client, manual, manual_turn, until
from test_server import run_with_server, speech
from tests_support import engine_read_async, engine_until

from s2s import Engine, EngineConfig
from speech.sample import synthesize

pytestmark = pytest.mark.paced  # servers at real time: alone and last (tests/conftest.py)

FRAME = 320  # samples in a codec frame at 24 kHz


def frames_in(events: list) -> int:
    """Frames of reply audio in `events`' deltas."""
    audio = sum(len(base64.b64decode(e.delta)) // 2 for e in events if e.type == "response.output_audio.delta")
    return audio // FRAME


@dataclass(frozen=True)
class Seen:
    """A conversation as the engine thread left it after a tick: copies (its sampling, immutable, is its own), which
    any thread may read. Its fields are named as `Session`'s, so one check reads either."""

    id: str
    turns: list
    user: object
    model: object
    user_frames: int
    phase: object
    sampling: object
    prompt_frames: int


def only(engine):
    """The engine's one conversation, or None: on the engine thread only."""
    sessions = list(engine.sessions.values())
    return sessions[0] if len(sessions) == 1 else None


def seen(s) -> Seen:
    """On the engine thread: `s` copied."""
    return Seen(
        s.id,
        copy.deepcopy(s.turns),
        copy.deepcopy(s.user),
        copy.deepcopy(s.model),
        s.user_frames,
        s.phase,
        s.sampling,
        s.prompt_frames,
    )


async def the_session(server, check=lambda s: True, what: str = "", timeout: float = 10.0) -> Seen:
    """The engine's one conversation once `check(session)` holds, both read on the engine thread after a tick (it
    applies a command at its next tick); a copy."""
    engine = server.engine
    what = what or "the engine did not come to hold one conversation as the test expects"
    return await engine_until(engine, lambda: (s := only(engine)) is not None and check(s) and seen(s), timeout, what)


def replied(s):
    """The first turn the engine replied to."""
    return next(t for t in s.turns if t.reply_start is not None)


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


QUESTION = "Good morning, can you hear me?"
AGAIN = "Wait, stop, I have another question."


async def speak_over_the_reply(conn, interrupt: bool) -> tuple[list, list, object]:
    """A question spoken in real time; once its long reply plays, more speech. The events up to the second
    `speech_started` (excluded), those after it up to `response.done` (excluded), and that `response.done`."""
    await until(conn, "session.created")
    detection = {"type": "server_vad", "interrupt_response": interrupt}
    session = {"type": "realtime", "audio": {"input": {"turn_detection": detection}}, "seed": 0}  # (as `manual`)
    await conn.send({"type": "session.update", "session": session})
    updated = await until(conn, "session.updated")
    assert updated.session.audio.input.turn_detection.interrupt_response is interrupt
    question = np.concatenate([synthesize(QUESTION), np.zeros(36000, np.float32)])  # 1.5 s of silence after
    sender = asyncio.create_task(append(conn, question, real_time=True))
    before: list = []
    await until(conn, "response.created", before)
    async with asyncio.timeout(30):
        while frames_in(before) < 20 or not sender.done():  # the reply plays; the question's silence is over
            before.append(await conn.recv())
    await sender
    speaker = asyncio.create_task(append(conn, synthesize(AGAIN), real_time=True))
    try:
        await until(conn, "input_audio_buffer.speech_started", before)
        after: list = []
        done = await until(conn, "response.done", after)
    finally:
        await stop(speaker)
    return before, after, done


def test_server_vad_barge_in_cancels_the_response_and_cuts_the_engines_reply(parts) -> None:
    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            before, after, done = await speak_over_the_reply(conn, interrupt=True)
            assert "response.done" not in [e.type for e in before]  # the reply was still playing at the barge-in
            assert done.response.status == "cancelled" and done.response.status_details.reason == "turn_detected"
            sent = frames_in(before + after)
            s = await the_session(server, lambda s: "interrupted" in replied(s).times, "the reply was not cut")
            turn = replied(s)
            assert turn.reply_end is not None and turn.reply_end - turn.reply_start <= sent < 400

    run_with_server(parts, body, OPTIONS, max_reply_frames=400)


def test_server_vad_without_interrupt_response_lets_the_response_finish(parts) -> None:
    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            before, after, done = await speak_over_the_reply(conn, interrupt=False)
            assert "response.done" not in [e.type for e in before]  # the speech came while the reply played
            turn = replied(await the_session(server))
            assert "interrupted" not in turn.times
            frames = frames_in(before + after)  # every frame of the reply reached the client
            assert turn.reply_end - turn.reply_start == frames
            assert done.response.status == ("incomplete" if frames == 300 else "completed")  # (its END code)

    run_with_server(parts, body, OPTIONS, max_reply_frames=300)


async def reply_playing(conn, seed: int = 0, frames: int = 20) -> list:
    """Manual mode: append, commit, ask for a response; the events until `frames` frames of it came."""
    await ask(conn, seed=seed)
    seen: list = []
    async with asyncio.timeout(30):
        while frames_in(seen) < frames:
            seen.append(await conn.recv())
    return seen


def test_output_audio_buffer_clear_cancels_and_keeps_only_what_was_sent(parts) -> None:
    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await manual(conn)
            seen = await reply_playing(conn)
            await conn.send({"type": "output_audio_buffer.clear"})
            done = await until(conn, "response.done", seen)
            assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"
            await until(conn, "output_audio_buffer.cleared")
            sent = frames_in(seen)
            s = await the_session(server, lambda s: "interrupted" in s.turns[0].times, "the reply was not cut")
            turn = s.turns[0]
            assert turn.reply_end - turn.reply_start <= sent < 400

    run_with_server(parts, body, OPTIONS, max_reply_frames=400)


def test_deleting_items_takes_their_frames_out_of_the_engines_context(parts) -> None:
    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await manual(conn)
            first = await manual_turn(conn, seed=0)
            await manual_turn(conn, seed=1)
            user0 = next(e for e in first if e.type == "input_audio_buffer.committed").item_id
            reply0 = first[-1].response.output[0].id
            s = await the_session(server)
            t0, t1 = s.turns
            reply_frames, user_frames, start = t0.reply_end - t0.reply_start, t0.reply_start, t1.first_frame
            user1, reply1 = (
                s.user[t1.first_frame : t1.reply_start].copy(),
                s.model[t1.reply_start : t1.reply_end].copy(),
            )

            await conn.send({"type": "conversation.item.delete", "item_id": reply0})
            assert (await until(conn, "conversation.item.deleted")).item_id == reply0
            s = await the_session(server, lambda s: s.turns[1].first_frame == start - reply_frames)
            t0, t1 = s.turns
            assert t0.reply_end == t0.reply_start == user_frames
            assert np.array_equal(s.user[t1.first_frame : t1.reply_start], user1)

            await conn.send({"type": "conversation.item.delete", "item_id": user0})
            assert (await until(conn, "conversation.item.deleted")).item_id == user0
            s = await the_session(server, lambda s: s.turns[1].first_frame == start - reply_frames - user_frames)
            t0, t1 = s.turns
            assert t0.first_frame == t0.reply_start == t0.reply_end == 0
            assert np.array_equal(s.user[t1.first_frame : t1.reply_start], user1)
            assert np.array_equal(s.model[t1.reply_start : t1.reply_end], reply1)

            third = await manual_turn(conn, seed=2)  # answered from the edited context, in full
            assert third[-1].response.status == "incomplete" and frames_in(third) == 20  # max_reply_frames
            s = await the_session(server)
            assert s.turns[2].reply_end - s.turns[2].reply_start == 20
            await engine_read_async(server.engine, server.engine.cache.check)

            await conn.send({"type": "conversation.item.delete", "item_id": user0})
            assert (await until(conn, "error")).error.code == "item_not_found"
            seen = await reply_playing(conn, seed=3, frames=1)  # (of 20)
            playing = next(e for e in seen if e.type == "response.output_item.added").item.id
            await conn.send({"type": "conversation.item.delete", "item_id": playing})
            error = await until(conn, "error", seen)
            assert error.error.code == "conversation_already_has_active_response"
            assert "in progress" in error.error.message
            assert "response.done" not in [e.type for e in seen]
            assert (await until(conn, "response.done")).response.output[0].id == playing

    run_with_server(parts, body, OPTIONS, max_reply_frames=20)


def test_input_audio_buffer_clear_drops_the_uncommitted_frames_in_the_engine(parts) -> None:
    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await manual(conn)
            await append(conn, speech(0.5))
            await conn.send({"type": "input_audio_buffer.commit"})
            await until(conn, "input_audio_buffer.committed")
            s = await the_session(server, lambda s: s.turns and s.turns[0].committed, "the commit did not land")
            committed = s.user_frames
            await append(conn, speech(0.5, seed=1))
            # encoded: frames of the open turn
            await the_session(server, lambda s: s.user_frames > committed, "the appended audio did not land")
            await conn.send({"type": "input_audio_buffer.clear"})
            await until(conn, "input_audio_buffer.cleared")
            await conn.send({"type": "input_audio_buffer.commit"})
            assert (await until(conn, "error")).error.code == "input_audio_buffer_commit_empty"
            s = await the_session(server, lambda s: s.user_frames == committed, "the clear did not drop the frames")
            assert [t.first_frame for t in s.turns] == [0, committed] and s.turns[0].committed

            seen = await manual_turn(conn, seed=2)  # the next audio follows the committed turn's
            assert seen[-1].response.status == "incomplete"
            s = await the_session(server)
            assert s.turns[1].first_frame == committed and s.turns[1].reply_start is not None

    run_with_server(parts, body, OPTIONS)


def test_response_metadata_is_echoed_and_what_cannot_be_answered_is_refused(parts) -> None:
    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await manual(conn)
            await ask(conn, response={"metadata": {"client_event_id": "x1"}})
            created = await until(conn, "response.created")
            assert created.response.metadata == {"client_event_id": "x1"}
            done = await until(conn, "response.done")
            assert done.response.id == created.response.id and done.response.metadata == {"client_event_id": "x1"}

            await conn.send({"type": "response.create"})  # no new audio
            assert (await until(conn, "error")).error.code == "no_input"

            await ask(conn, seed=1)
            await conn.send({"type": "response.create"})
            seen: list = []
            error = await until(conn, "error", seen)
            assert error.error.code == "conversation_already_has_active_response"
            done = await until(conn, "response.done", seen)
            assert done.response.status == "incomplete" and done.response.metadata is None
            assert [e.type for e in seen].count("response.created") == 1

    run_with_server(parts, body, OPTIONS)


def test_session_update_sampling_reaches_the_engine_and_a_bad_one_changes_nothing(parts) -> None:
    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await until(conn, "session.created")
            await conn.send({"type": "session.update", "session": {"type": "realtime", "temperature": 0, "seed": 3}})
            updated = await until(conn, "session.updated")
            assert updated.session.to_dict()["temperature"] == 0 and updated.session.to_dict()["seed"] == 3
            s = await the_session(server, lambda s: s.sampling.temperature == 0 and s.sampling.seed == 3)
            sampling = s.sampling
            for bad, name in (({"top_k": 2000}, "top_k"), ({"temperature": -1}, "temperature")):
                await conn.send({"type": "session.update", "session": {"type": "realtime", "seed": 4, **bad}})
                error = await until(conn, "error")
                assert error.error.code == "invalid_session" and name in error.error.message, error.error.message
            await conn.send({"type": "session.update", "session": {"type": "realtime"}})
            shown = (await until(conn, "session.updated")).session.to_dict()
            assert (shown["temperature"], shown["top_k"], shown["seed"]) == (0, 250, 3)
            assert (await the_session(server)).sampling is sampling

    run_with_server(parts, body, OPTIONS)


def test_a_voice_prompt_is_chosen_before_audio_and_not_after(parts) -> None:
    cfg = parts[0].config
    codes = np.random.default_rng(0).integers(0, cfg.codebook_size, (cfg.num_codebooks, 20))

    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await until(conn, "session.created")
            first = await the_session(server)
            voice = {"type": "session.update", "session": {"type": "realtime", "audio": {"output": {"voice": "bob"}}}}
            await conn.send(voice)
            error = await until(conn, "error")
            assert error.error.code == "invalid_session" and "alice" in error.error.message

            voice["session"]["audio"]["output"]["voice"] = "alice"
            await conn.send(voice)
            assert (await until(conn, "session.updated")).session.audio.output.voice == "alice"
            s = await the_session(server, lambda s: s.id != first.id, "the conversation did not reopen on the voice")
            assert s.prompt_frames == 20 and np.array_equal(s.model[:20].T, codes)

            await append(conn, speech(0.3))
            voice["session"]["audio"]["output"]["voice"] = None
            await conn.send(voice)
            error = await until(conn, "error")
            assert error.error.code == "invalid_session" and "voice" in error.error.message
            await conn.send({"type": "session.update", "session": {"type": "realtime"}})
            assert (await until(conn, "session.updated")).session.audio.output.voice == "alice"
            assert await engine_read_async(server.engine, lambda: list(server.engine.sessions)) == [s.id]
            assert (await the_session(server)).prompt_frames == 20

    run_with_server(parts, body, OPTIONS, voices={"alice": codes})


BETA_SESSION = {
    "voice": None,
    "turn_detection": {"type": "server_vad", "silence_duration_ms": 300},
    "input_audio_format": "pcm16",
    "output_audio_format": "pcm16",
    "modalities": ["audio", "text"],
}


def test_a_beta_client_updates_the_session_with_the_betas_fields(parts) -> None:
    async def body(url, server):
        async with client(url).beta.realtime.connect(model="gpt-4o-realtime-preview") as conn:
            await until(conn, "session.created")
            await conn.send({"type": "session.update", "session": BETA_SESSION})
            session = (await until(conn, "session.updated")).session
            assert session.turn_detection.type == "server_vad" and session.turn_detection.silence_duration_ms == 300
            assert session.input_audio_format == session.output_audio_format == "pcm16"
            assert session.voice is None and session.modalities == ["audio", "text"]
            assert "audio" not in session.to_dict()

            await conn.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
            error = await until(conn, "error")
            assert error.error.code == "invalid_session" and "audio" in error.error.message
            await conn.send({"type": "session.update", "session": {}})
            assert (await until(conn, "session.updated")).session.turn_detection.silence_duration_ms == 300

    run_with_server(parts, body, OPTIONS)


def test_a_commit_while_a_response_plays_is_answered_after_it(parts) -> None:
    """Audio appended and committed while a response plays is held by the engine (the user's stream is silent
    during a reply) and becomes the next turn once the reply is over; the commit closes it then, and the next
    `response.create` answers it."""

    async def body(url, server):
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await manual(conn)
            seen = await reply_playing(conn, frames=1)  # (of 60)
            await append(conn, speech(0.5, seed=1))
            await conn.send({"type": "input_audio_buffer.commit"})
            await until(conn, "input_audio_buffer.committed", seen)
            assert (await until(conn, "response.done", seen)).response.status == "incomplete"
            await conn.send({"type": "response.create"})  # to the audio committed meanwhile
            try:
                done = await until(conn, "response.done", timeout=30)
            except TimeoutError:
                done = None
            s = await the_session(server)
            reply = s.user[s.turns[0].reply_start : s.turns[0].reply_end]
            heard = int((reply != server.engine.model.config.silent_id).any(axis=1).sum())
            assert done is not None, (
                f"no response.done: the engine has turns {s.turns}, and {heard} frames of the first reply hold "
                "the user's audio committed during it"
            )
            assert len(s.turns) == 2 and s.turns[1].first_frame >= s.turns[0].reply_end

    run_with_server(parts, body, OPTIONS, max_reply_frames=60)


def test_audio_pushed_after_end_turn_is_not_what_the_reply_answers(parts) -> None:
    """What `RealtimeSession.end_turn` asks of the engine at the server VAD's end of turn (commit, then end_turn),
    with the next slice of the microphone's audio pushed before the engine's next tick: the reply answers the
    committed turn, and that audio is the next turn's, after the reply."""
    model, tok = parts
    cfg = EngineConfig(num_pages=512, max_context=1024, calibration_ticks=0, max_reply_frames=10)
    engine = Engine(model, tok, cfg)
    cid = engine.open("turn")
    engine.push_audio(cid, speech(0.5))
    engine.commit(cid)
    engine.end_turn(cid)
    engine.push_audio(cid, speech(0.1, seed=1))  # the buffer's next audio
    for _ in range(5):
        engine.step()
    s = engine.sessions[cid]
    turns = [(t.id, t.first_frame, t.committed, t.reply_start) for t in s.turns]
    assert s.turns[0].reply_start is not None, f"the reply answers another turn than the committed one: {turns}"
    for _ in range(100):
        if s.turns[0].reply_end is not None and s.phase.value == "listen":
            break
        engine.step()
    assert len(s.turns) == 2 and s.turns[1].first_frame >= s.turns[0].reply_end  # held, then heard after the reply
    assert s.user_frames > s.turns[1].first_frame
