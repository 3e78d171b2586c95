"""The Realtime API over a full-duplex model with a text stream (Moshi's family, `server/realtime/duplex.py`): the
user's audio streams in with no commits, and the model's speech comes out as responses, one per utterance, cut from
its stream by its text; the text goes out as transcript deltas, the `.done` transcript and the item's transcript.

The model is a tiny Kyutai-layout folder with a tiny Mimi of 80 ms frames, written by Kyutai's own code
(`tests/moshi_reference.py`, in .venv-moshi), served by `s2s serve --model DIR` and driven by the `openai` SDK. Its
random weights are steered so that utterances begin and end (`steer`): the model speaks random words while it hears
sound and pads in silence. What the client gets is compared, exactly, with the text ids the model sampled (read on
the engine thread), cut into utterances here on their own."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from moshi_reference import MOSHI_PYTHON, run_reference, tiny_lm_kwargs, tiny_mimi_config
from safetensors.torch import load_file, save_file
from test_realtime import append, client, until
from test_server import speech
from tests_support import on_engine_thread, served
from tests_support import until as wait_for

from codec.pcm import SAMPLE_RATE, to_pcm16
from s2s import AudioEvent, Engine
from s2s.engine.events import EventQueue
from s2s.models.moshi.text import TextPieces
from server.cli.engine_args import engine_of
from server.cli.main import parser
from server.connection import Limits
from server.moshi.protocol import ProtocolError
from server.protocols import Request
from server.realtime.config import SessionConfig
from server.realtime.duplex import UNSUPPORTED, UTTERANCE_END_S, DuplexSession
from server.realtime.wire import RealtimeWire

FRAME = 1920  # Mimi's 80 ms at 24 kHz: one text id a frame
END = math.ceil(UTTERANCE_END_S * SAMPLE_RATE / FRAME)  # padding frames that end an utterance: 13
PAD = 3  # Kyutai's text padding id (and 0, the end of a padding)
PART_TYPES = (
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
)
DONE_TYPES = (
    "response.output_audio.done",
    "response.output_audio_transcript.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
)


def sound_and_silence(*spans: float) -> np.ndarray:
    """`speech` and digital silence in turn, `spans` seconds each, sound first (the Mimi's codes for silence at the
    start of a stream are not those it gives silence later, which `steer` reads as silence)."""
    parts = [speech(s, i) if i % 2 == 0 else np.zeros(int(s * SAMPLE_RATE), np.float32) for i, s in enumerate(spans)]
    return np.concatenate(parts)


def steer(src: Path, dst: Path, silence: int) -> None:
    """`src`'s checkpoint, its text steered by what the model hears, written to `dst`: the LM's embedding of the
    user's first (semantic) codebook dominates its temporal state (1,000 times its other inputs), one direction for
    `silence` (the code the Mimi gives digital silence) and Kyutai's initial token, another for every other code; the
    text head reads the padding id from the first direction and the word pieces (ids 4 on, their random logits kept
    between them) from the second. So the model pads while it hears silence and samples random words while it hears
    sound: its utterances begin with the user's sound and end in the user's silence."""
    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    emb, head = weights["emb.8.weight"], weights["text_linear.weight"]  # (emb.8: the user's codebook 0, dep_q 8)
    directions, _ = torch.linalg.qr(torch.randn(head.shape[1], 2, generator=torch.Generator().manual_seed(0)))
    pad, word = directions.T
    emb[:] = 1000 * word
    emb[silence] = emb[-1] = 1000 * pad
    head[4:] += 3 * word
    head[PAD] = 3 * pad
    head[:PAD] = -3 * (pad + word)  # (no <unk>, <s> or </s>)
    save_file(weights, str(dst / "model.safetensors"))


def serve_args(folder: Path) -> list[str]:
    return ["serve", "--model", str(folder), "--threads", "1", "--admission-headroom", "inf"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    if not MOSHI_PYTHON.exists():
        pytest.skip(f"Kyutai's moshi needs {MOSHI_PYTHON} (scripts/setup_moshi_client.sh)")
    out = tmp_path_factory.mktemp("moshi_realtime")
    lm = tiny_lm_kwargs(8)
    mimi = tiny_mimi_config(n_q=8, bins=lm["card"], ratios=(8, 6, 5, 4))  # a 960-sample hop, 2x down: 80 ms frames
    run_reference({"configs": [{"name": "m", "seed": 3, "lm": lm, "batch": 1, "steps": 4, "mimi_config": mimi}]}, out)
    _, tok = engine_of(parser().parse_args(serve_args(out / "m")))
    silence = int(tok.encode(np.zeros(16 * FRAME, np.float32))[0, 0, -1])
    steer(out / "m", out / "steered", silence)
    return out / "steered"


def serve_engine(folder: Path) -> Engine:
    """The engine `s2s serve --model DIR` builds."""
    engine, _ = engine_of(parser().parse_args(serve_args(folder)))
    assert engine.cfg.frame_size == FRAME and engine.model.config.text_stream
    return engine


def utterances(pieces: TextPieces, ids: list[int]) -> tuple[list[tuple[int, int]], int | None]:
    """The utterances in a stream of text ids, as `[first, end)` indices: from an id with text to the `END`-th
    padding id after its last text, included; and where one still open began (None: none is)."""
    done, start, quiet = [], None, 0
    for f, i in enumerate(ids):
        spoken = 0 <= i < pieces.vocab_size and pieces.text([i]) != ""
        if start is None and not spoken:
            continue
        if start is None:
            start = f
        quiet = 0 if spoken else quiet + 1
        if quiet == END:
            done.append((start, f + 1))
            start = None
    return done, start


# ---- the session, on events made here ------------------------------------------------------------------------


def test_a_duplex_session_shows_no_turn_detection_and_refuses_one() -> None:
    config = DuplexSession.initial_config(None)
    assert config.duplex and config.turn_detection is None
    assert config.view(False, "s", "m")["audio"]["input"]["turn_detection"] is None
    assert config.view(True, "s", "m")["turn_detection"] is None
    for beta, session in (
        (False, {"audio": {"input": {"turn_detection": {"type": "server_vad"}}}}),
        (True, {"turn_detection": {"type": "semantic_vad"}}),
        (False, {"audio": {"input": {"turn_detection": {"type": "server_vad"}}}, "temperature": 0.5}),
    ):
        with pytest.raises(ProtocolError, match="full duplex") as e:
            config.update(session, beta, [], 96)
        assert e.value.code == "invalid_session"
    same = config.update({"audio": {"input": {"turn_detection": None}}, "temperature": 0.5}, False, [], 96)
    assert same.turn_detection is None and same.duplex and same.sampling.temperature == 0.5
    # a turn-mode session is as it was
    assert SessionConfig().update({"turn_detection": {"type": "server_vad"}}, True, [], 96).turn_detection


class Conn:
    """What a session sends through the connection core, as the client reads it (the wire's JSON)."""

    def __init__(self, beta: bool = False):
        self.wire, self.limits, self.sent = RealtimeWire(beta), Limits(), []

    async def send_audio(self, pcm: np.ndarray, turn: int) -> bool:
        self.sent += [json.loads(m) for m in self.wire.audio(pcm)]
        return True

    async def send_event(self, data: dict) -> None:
        self.sent.append(json.loads(self.wire.event(data)))

    async def send_error(self, text: str, code: str = "invalid_request") -> None:
        self.sent.append(json.loads(self.wire.error(text, code)))


class FakeEngine:
    """A duplex conversation's events, put by the test."""

    def __init__(self, pieces: TextPieces):
        self.model = SimpleNamespace(config=SimpleNamespace(text_stream=True, codebook_size=96), text_pieces=pieces)
        self.cfg = SimpleNamespace(frame_size=FRAME)
        self.queue, self.voices, self.pushed, self.modes = EventQueue(FRAME), {}, 0, []

    def open(self, mode: str, prompt=None, sampling=None) -> str:
        self.modes.append(mode)
        return "c"

    def event_queue(self, cid: str) -> EventQueue:
        return self.queue

    def push_audio(self, cid: str, pcm: np.ndarray) -> None:
        self.pushed += len(pcm)

    def set_sampling(self, cid: str, sampling) -> None:
        self.sampling = sampling

    def close(self, cid: str) -> None:
        self.queue.put(None)


def frames_pcm(first: int, n: int) -> np.ndarray:
    """Frames `first .. first + n - 1`, each all samples `frame / 256` (whole in pcm16)."""
    return np.repeat(np.arange(first, first + n, dtype=np.float32) / 256, FRAME)


def test_responses_are_cut_from_the_stream_by_its_text(folder) -> None:
    """Text ids in events of several frames: a response starts at the first frame with text, goes on over padding
    shorter than `END` frames and across events, and ends with the `END`-th padding frame; frames outside responses
    (padding, ids no tokenizer has) are not sent; each delta carries its frames' audio, then their text."""
    pieces = TextPieces(folder / "tokenizer.model", (PAD, 0))
    w = [i for i in range(4, 128) if pieces.text([i])][:4]
    events = [  # frame 1 on
        [PAD, PAD, w[0], PAD],  # 1-4: the first response starts at frame 3
        [PAD] * 5 + [w[1]] + [PAD] * 10,  # 5-20: padding of 6, then 10: it goes on
        [PAD, PAD, PAD, 0],  # 21-24: ends with frame 23 (13 frames of padding); 24 is not sent
        [128, PAD, w[2], w[3]],  # 25-28: the second starts at frame 27
        [PAD] * (END - 1),  # 29-40: one frame short of its end
        [0, w[0]],  # 41-42: the end-of-padding id 0 ends it at frame 41; the third starts at 42
    ]

    async def run() -> tuple[Conn, FakeEngine]:
        engine, conn = FakeEngine(pieces), Conn()
        session = await DuplexSession.open(engine, conn, None, None, "m", None)
        assert engine.modes == ["duplex"] and session.vad is None and session.gate is None
        session.audio(np.zeros(FRAME, np.float32))
        first = 1
        for ids in events:
            engine.queue.put(AudioEvent("c", 0, first, frames_pcm(first, len(ids)), text=np.array(ids)))
            first += len(ids)
        engine.queue.put(None)
        await asyncio.wait_for(session._sender, 5)
        return conn, engine

    conn, engine = asyncio.run(run())
    assert engine.pushed == FRAME
    kinds = [e["type"] for e in conn.sent]
    delta, text = "response.output_audio.delta", "response.output_audio_transcript.delta"
    first = [*PART_TYPES, delta, text, delta, text, delta, *DONE_TYPES]
    second = [*PART_TYPES, delta, text, delta, delta, *DONE_TYPES]
    third = [*PART_TYPES, delta, text]
    assert kinds == first + second + third, kinds

    def audio(events: list[dict]) -> bytes:
        return b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == delta)

    responses = [conn.sent[: len(first)], conn.sent[len(first) : len(first) + len(second)]]
    for sent, (a, b), ids in zip(responses, ((3, 24), (27, 42)), (w[:2], w[2:]), strict=True):
        (done,) = [e for e in sent if e["type"] == "response.done"]
        rid, iid = done["response"]["id"], done["response"]["output"][0]["id"]
        assert all(e.get("response_id", rid) == rid and e.get("item_id", iid) == iid for e in sent)
        assert audio(sent) == to_pcm16(frames_pcm(a, b - a))
        transcript = pieces.text(ids)
        assert "".join(e["delta"] for e in sent if e["type"] == text) == transcript
        (td,) = [e for e in sent if e["type"] == "response.output_audio_transcript.done"]
        (part,) = [e for e in sent if e["type"] == "response.content_part.done"]
        (item,) = [e for e in sent if e["type"] == "response.output_item.done"]
        assert td["transcript"] == part["part"]["transcript"] == transcript
        for shown in (item["item"], done["response"]["output"][0]):
            assert shown["content"] == [{"type": "output_audio", "transcript": transcript}]
            assert shown["status"] == "completed" and shown["role"] == "assistant"
        assert done["response"]["status"] == "completed"
    assert responses[1][2]["previous_item_id"] == responses[0][2]["item"]["id"]  # conversation.item.added
    assert audio(conn.sent[len(first) + len(second) :]) == to_pcm16(frames_pcm(42, 1))


def test_events_that_cannot_apply_to_a_duplex_stream_are_errors_that_change_nothing(folder) -> None:
    pieces = TextPieces(folder / "tokenizer.model", (PAD, 0))

    async def run() -> list[str]:
        engine, conn = FakeEngine(pieces), Conn()
        session = await DuplexSession.open(engine, conn, None, None, "m", None)
        codes = []
        for kind in [*UNSUPPORTED, "conversation.item.create"]:
            with pytest.raises(ProtocolError) as e:
                await session.request(Request({"type": kind, "item_id": "item_x", "audio_end_ms": 0}))
            assert e.value.code == "unsupported_event" and str(e.value).startswith(kind), str(e.value)
            codes.append(str(e.value))
        await session.request(Request({"type": "session.update", "session": {"seed": 7}}))
        (updated,) = conn.sent
        assert updated["type"] == "session.updated" and updated["session"]["seed"] == 7
        assert updated["session"]["audio"]["input"]["turn_detection"] is None
        await session.close()
        return codes

    messages = asyncio.run(run())
    assert set(UNSUPPORTED) == {
        "input_audio_buffer.commit",
        "input_audio_buffer.clear",
        "response.create",
        "response.cancel",
        "output_audio_buffer.clear",
        "conversation.item.truncate",
        "conversation.item.delete",
    }
    assert all("full duplex" in m for m in messages[:-1]), messages


def test_the_steered_model_pads_in_silence_and_speaks_over_sound(folder) -> None:
    """The fixture's premise, on the engine alone: its utterances follow the user's sound."""
    engine = serve_engine(folder)
    pcm = sound_and_silence(1.2, 2.4, 0.8, 2.4)
    cid = engine.open("duplex")
    ids: dict[int, int] = {}
    for a in range(0, len(pcm), FRAME):
        engine.push_audio(cid, pcm[a : a + FRAME])
        engine.step()
        s = engine.sessions[cid]
        ids |= {f: int(s.model[f][0]) for f in range(max(1, s.computed - 8), s.computed)}
    text = [ids[f] for f in sorted(ids)]
    done, open_at = utterances(engine.model.text_pieces, text)
    assert open_at is None, text
    sound = [(0, 15), (45, 55)]  # its frames: 1.2 s of sound, 2.4 s of silence, 0.8 s of sound, 2.4 s of silence
    assert len(done) == len(sound), (done, text)
    for (a, b), (start, stop) in zip(done, sound, strict=True):  # (text index i: frame i + 1)
        first, last = a + 1, b - END  # its first and last frames with text
        assert start <= first < stop <= last + 1 <= stop + 3, (done, text)  # (the Mimi lags a frame or two)


# ---- served ---------------------------------------------------------------------------------------------------


class TextIds:
    """The one open conversation's text ids, frame 1 on, read on the engine thread after every tick."""

    def __init__(self, engine: Engine):
        self.ids: dict[int, int] = {}
        self.sessions: set[str] = set()

        def record() -> None:
            for cid, s in list(engine.sessions.items()):
                self.sessions.add(cid)
                start = max(1, max(self.ids, default=0) - 4)  # (a tick computes a few frames: all still held)
                self.ids = self.ids | {f: int(s.model[f][0]) for f in range(start, s.computed)}  # (one swap)

        self.future = on_engine_thread(engine, record, repeat=True)

    def stop(self) -> list[int]:
        self.future.cancel()
        if self.future.done() and not self.future.cancelled():
            self.future.result()  # (an error on the engine thread)
        assert len(self.sessions) == 1, self.sessions
        assert sorted(self.ids) == list(range(1, 1 + len(self.ids)))
        return [self.ids[f] for f in sorted(self.ids)]


async def stream(engine: Engine, conn, pcm: np.ndarray, ids: TextIds) -> list:
    """`pcm` appended in real time; every event until the engine has computed its frames and every utterance in
    them has its `response.done`."""
    received: list = []

    async def receive() -> None:
        while True:
            received.append(await conn.recv())

    receiver = asyncio.create_task(receive())
    try:
        await append(conn, pcm, real_time=True)
        pieces, frames = engine.model.text_pieces, len(pcm) // FRAME

        def over() -> bool:
            seen = ids.ids
            text = [seen[f] for f in sorted(seen)]
            dones = sum(e.type == "response.done" for e in received)
            return len(text) >= frames - 2 and dones == len(utterances(pieces, text)[0])

        await wait_for(over, 30, lambda: f"{len(ids.ids)} frames, {[e.type for e in received][-20:]}")
        await asyncio.sleep(0.5)  # (anything more would come now)
    finally:
        receiver.cancel()
    return received


def responses(events: list) -> list[list]:
    """The events of each response, `response.created` to `response.done`: every event is one of them."""
    out: list[list] = []
    for e in events:
        if e.type == "response.created":
            out.append([])
        assert out and (not out[-1] or out[-1][-1].type != "response.done"), [e.type for e in events]
        out[-1].append(e)
    assert all(r[-1].type == "response.done" for r in out), [e.type for e in events]
    return out


def check_response(events: list, names: dict[str, str], pieces: TextPieces, ids: list[int]) -> None:
    """One response's events, in order, against the text ids of its frames. `names`: the beta's (or {}: GA)."""

    def name(kind: str) -> str:
        return names.get(kind, kind)

    kinds = [e.type for e in events]
    head = [name(k) for k in PART_TYPES]
    tail = [name(k) for k in DONE_TYPES if not (names and k == "conversation.item.done")]  # (GA's only)
    assert kinds[: len(head)] == head and kinds[-len(tail) :] == tail, kinds
    delta, text = name("response.output_audio.delta"), name("response.output_audio_transcript.delta")
    middle = kinds[len(head) : -len(tail)]
    assert set(middle) <= {delta, text} and middle[0] == delta, middle
    rid, iid = events[-1].response.id, events[-1].response.output[0].id
    assert all(getattr(e, "response_id", rid) == rid and getattr(e, "item_id", iid) == iid for e in events)
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == delta)
    assert len(audio) == 2 * FRAME * len(ids) and any(audio), (len(audio), len(ids))
    transcript = pieces.text(ids)
    assert transcript.strip(), ids
    assert "".join(e.delta for e in events if e.type == text) == transcript
    (td,) = [e for e in events if e.type == name("response.output_audio_transcript.done")]
    (part,) = [e for e in events if e.type == "response.content_part.done"]
    (item,) = [e for e in events if e.type == "response.output_item.done"]
    assert td.transcript == part.part.transcript == transcript
    for shown in (item.item, events[-1].response.output[0]):
        assert [c.transcript for c in shown.content] == [transcript] and shown.status == "completed"
    assert events[-1].response.status == "completed"


def check(engine: Engine, events: list, ids: list[int], names: dict[str, str]) -> int:
    """Every response against the utterances of the model's text ids; how many there were."""
    pieces = engine.model.text_pieces
    cut, open_at = utterances(pieces, ids)
    assert open_at is None, ids  # (the stream ends in silence: every utterance has ended)
    got = responses(events)
    assert len(got) == len(cut), ([e.type for e in events], cut)
    for response, (a, b) in zip(got, cut, strict=True):
        check_response(response, names, pieces, ids[a:b])
    delta = names.get("response.output_audio.delta", "response.output_audio.delta")
    sent = sum(len(base64.b64decode(e.delta)) for e in events if e.type == delta) // (2 * FRAME)
    assert sent == sum(b - a for a, b in cut) < len(ids)  # the model's silence is not sent
    return len(got)


@pytest.mark.paced  # a server at real time: alone and last (tests/conftest.py)
def test_the_sdk_streams_audio_and_gets_each_utterance_as_a_response_with_its_transcript(folder) -> None:
    engine = serve_engine(folder)
    pcm = sound_and_silence(1.2, 2.4, 0.8, 2.4)

    async def body(url: str) -> tuple[list, list, list[int]]:
        ids = TextIds(engine)
        async with client(url).realtime.connect(model="moshi") as conn:
            created = await until(conn, "session.created")
            assert created.session.audio.input.turn_detection is None
            await conn.send({"type": "session.update", "session": {"type": "realtime", "seed": 5}})
            assert (await until(conn, "session.updated")).session.audio.input.turn_detection is None
            errors = []
            for kind in ("input_audio_buffer.commit", "input_audio_buffer.clear", "response.create"):
                await conn.send({"type": kind})
                errors.append(await until(conn, "error"))
            await conn.send({"type": "response.cancel"})
            errors.append(await until(conn, "error"))
            vad = {"audio": {"input": {"turn_detection": {"type": "server_vad"}}}}
            await conn.send({"type": "session.update", "session": vad})
            errors.append(await until(conn, "error"))
            events = await stream(engine, conn, pcm, ids)
        await wait_for(lambda: not engine.snapshot().conversations, 10, "the conversation stays")
        return errors, events, ids.stop()

    errors, events, ids = asyncio.run(served(engine, body))
    assert [e.error.code for e in errors] == ["unsupported_event"] * 4 + ["invalid_session"]
    assert all("full duplex" in e.error.message for e in errors), [e.error.message for e in errors]
    assert not [e for e in events if e.type == "error"], [e for e in events if e.type == "error"]
    assert check(engine, events, ids, {}) == 2  # the two sounds', each ended by the silence after it


@pytest.mark.paced
def test_a_beta_client_gets_the_beta_names(folder) -> None:
    engine = serve_engine(folder)
    pcm = sound_and_silence(0.8, 2.0)
    names = {
        "conversation.item.added": "conversation.item.created",
        "response.output_audio.delta": "response.audio.delta",
        "response.output_audio.done": "response.audio.done",
        "response.output_audio_transcript.delta": "response.audio_transcript.delta",
        "response.output_audio_transcript.done": "response.audio_transcript.done",
    }

    async def body(url: str) -> tuple[list, list[int]]:
        ids = TextIds(engine)
        async with client(url).beta.realtime.connect(model="moshi") as conn:
            created = await until(conn, "session.created")
            assert created.session.turn_detection is None
            events = await stream(engine, conn, pcm, ids)
        await wait_for(lambda: not engine.snapshot().conversations, 10, "the conversation stays")
        return events, ids.stop()

    events, ids = asyncio.run(served(engine, body))
    kinds = {e.type for e in events}
    assert not kinds & (set(names) | {"conversation.item.done"}), kinds
    assert check(engine, events, ids, names) == 1
