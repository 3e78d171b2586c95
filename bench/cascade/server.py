"""CascadeServer: a cascaded STT -> LLM -> TTS pipeline behind Moshi's protocol in turn mode, as a protocol on the
server's connection core (`server/connection.py`), built from real parts, as the baseline `s2s bench cascade`
measures this server against.

Stages of one turn, each stamped (`time.perf_counter`, the same monotonic clock as the engines') into the metadata
message sent right after the first reply audio:

- endpointing: `server/vad/endpointer.py`'s `Endpointer`, the turn mode's settings except `silence_ms` (a query
  parameter);
- speech-to-text: pocketsphinx (`bench/cascade/stt.py`) in worker processes, fed while the user speaks; at the
  endpoint only its final search is left. Accuracy on espeak-ng voices is poor; what is measured is latency;
- text decoder: `S2SModel` with one codebook of 256 bytes, the speech model's size, served by a codec-free `Engine`
  (`bench/cascade/text.py`); the transcript goes in as the user stream, the reply streams out token by token
  (15 bytes a second of `--max-reply-frames`' speech: about 15 characters a second). Random weights give random
  bytes: each becomes a letter, or a space one time in six (words of about five letters);
- phrase aggregation, pipecat-style: the first phrase goes to speech at the first word boundary, later ones at the
  first word boundary after `PHRASE_CHARS` characters, the rest when the reply ends;
- text-to-speech (`tts=espeak|engine`): espeak-ng, or the speech `S2SModel` served by a second `Engine` with the
  codec, the phrase's bytes as its user stream (both codebooks), generating codes turned into audio by the streaming
  decoder; once it has made a character's frames (`CHARS_PER_S`), the reply is cut (`interrupt`).

Admission: a connection is refused when speech-to-text could not take another stream in real time
(`SttWorkers.open`: after the upgrade, 1013) or when the speech engine would refuse it (`ChatServer.busy`: 503
before the upgrade), so that the cascade serves the conversations it admits at its
best rather than all of them late.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import numpy as np
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed

from bench.cascade.stt import AtCapacity, SttStream, SttWorkers, default_workers
from bench.cascade.text import CHARS_PER_S, PHRASE_CHARS, printable, split_phrase
from codec.pcm import load_wav
from s2s import AudioEvent, Engine, MetaEvent, Refused, SamplingParams
from s2s.engine.engine import CodesEvent
from server.app import ChatServer, ServerOptions
from server.connection import Connection, Opener
from server.engine_session import events
from server.moshi.endpoint import MoshiWire, protocol, sampling_of
from server.moshi.protocol import ProtocolError
from server.vad.config import VadConfig
from speech.sample import SAMPLE_PATH, synthesize

log = logging.getLogger("s2s.cascade")


class CascadeServer(ChatServer):
    """/api/chat is the cascade; the rest (HTTP, /metrics of the speech engine, limits) is `ChatServer`'s."""

    def __init__(
        self,
        text_engine: Engine,
        speech_engine: Engine,
        options: ServerOptions | None = None,
        stt_workers: int | None = None,
    ):
        super().__init__(speech_engine, options)
        self.text_engine = text_engine
        self.stt = SttWorkers(
            default_workers() if stt_workers is None else stt_workers,
            text_engine.cfg.admission_headroom,
            text_engine.cfg.max_conversations,
        )
        self.endpoints = {"/api/chat": CascadeEndpoint(self)}

    async def start(self) -> int:
        self.text_engine.start()
        self.engine.start()
        await self.stt.start(load_wav(SAMPLE_PATH))  # calibrated beside the running engines
        return await self._listen()

    async def stop(self) -> None:
        await super().stop()
        await asyncio.to_thread(self.text_engine.stop)
        await asyncio.to_thread(self.stt.shutdown)


class CascadeEndpoint:
    """Query parameters: `mode=turn` (its only mode), `codec=opus|pcm16`, `tts=espeak|engine`, `silence_ms`, `seed`
    (0 by default)."""

    def __init__(self, server: CascadeServer):
        self.server = server

    def error(self, text: str) -> bytes:
        return protocol.error(text)

    def accept(self, query: dict[str, str], headers: Headers) -> tuple[MoshiWire, Opener]:
        if query.get("mode", "turn") != "turn":
            raise ProtocolError("the cascade has turn mode only (mode=turn)")
        wire = MoshiWire(query.get("codec", "opus"))
        tts = query.get("tts", "espeak")
        if tts not in ("espeak", "engine"):
            raise ProtocolError(f"tts must be espeak or engine, got {tts!r}")
        vad = self.server.options.vad
        try:
            silence_ms = float(query.get("silence_ms", vad.silence_s * 1000))
        except ValueError as e:
            raise ProtocolError(f"bad silence_ms: {e}") from e
        sampling = sampling_of({"seed": query.get("seed", "0")}, self.server.text_engine.model.config.codebook_size)
        if not 0 < silence_ms <= 5000:
            raise ProtocolError(f"silence_ms must be in (0, 5000], got {silence_ms}")
        vad = dataclasses.replace(vad, silence_s=silence_ms / 1000)

        def open_session(conn: Connection):
            return CascadeSession.open(self.server, conn, tts, sampling, vad)

        return wire, open_session


class CascadeSession:
    """One connection's pipeline: speech-to-text fed while the user speaks (as pipecat runs its STT service), and at
    each endpoint the text decoder's reply spoken phrase by phrase. It takes no barge-in: a reply plays out."""

    def __init__(
        self,
        server: CascadeServer,
        conn: Connection,
        tts: str,
        opened: list[tuple[Engine, str]],
        stt: SttStream,
        vad: VadConfig,
    ):
        self.server, self.conn, self.tts, self.opened, self.stt, self.vad = server, conn, tts, opened, stt, vad
        self.gate = None  # every turn end is answered: the speech engine's load is not the cascade's
        self.text_cid = opened[0][1]
        self.speech_cid = opened[1][1] if tts == "engine" else None
        self.info = {"session": self.text_cid, "mode": "turn", "tts": tts}
        self.stt_in: asyncio.Queue = asyncio.Queue()  # PCM blocks to transcribe, or a future for the transcript
        self.turns = 0
        self.speech_turn = -1  # the speech engine's last finished turn
        self.reply: asyncio.Task | None = None
        self.transcriber = asyncio.create_task(self._transcribe())

    @classmethod
    async def open(
        cls, server: CascadeServer, conn: Connection, tts: str, sampling: SamplingParams, vad: VadConfig
    ) -> CascadeSession:
        """Speech-to-text, then the engines; `Refused` when any of them cannot take the connection."""
        opened: list[tuple[Engine, str]] = []
        stt: SttStream | None = None
        engines = [server.text_engine, server.engine] if tts == "engine" else [server.text_engine]
        try:
            stt = server.stt.open()  # first, and before any await: connections arriving together see each other's
            for engine in engines:
                opened.append((engine, engine.open("turn", sampling=sampling)))
        except BaseException as e:  # a refusal, or anything else: what was opened is given back
            for engine, cid in opened:
                engine.close(cid)
            if stt is not None:
                await stt.close()
            if isinstance(e, AtCapacity):
                raise Refused(str(e)) from e
            raise
        return cls(server, conn, tts, opened, stt, vad)

    async def barge_in(self, played_samples: int) -> None:
        pass  # the cascade's replies play out

    def audio(self, pcm: np.ndarray) -> None:
        self.stt_in.put_nowait(pcm)

    async def end_turn(self) -> None:
        endpoint = time.perf_counter()
        if self.reply is None or self.reply.done():
            self.reply = asyncio.create_task(self._reply_or_error(endpoint))

    async def speech_ended(self) -> None:
        pass  # no turn: nothing to answer

    async def stream(self, action: str) -> None:
        raise ProtocolError(f"the cascade cannot {action} its stream")

    async def close(self) -> None:
        if self.reply is not None:
            self.reply.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                await self.reply
        self.stt_in.put_nowait(None)  # the transcriber ends after what it holds: its decoder is then free
        await self.transcriber
        for engine, cid in self.opened:
            engine.close(cid)
        await self.stt.close()

    async def _transcribe(self) -> None:
        """Blocks in arrival order; a future asks for the final transcript of everything before it; None ends it.
        A failure closes the connection."""
        failed: Exception | None = None  # once the recognizer fails, every later transcript request gets the error
        while (item := await self.stt_in.get()) is not None:
            try:
                if failed is not None:
                    raise failed
                if isinstance(item, asyncio.Future):
                    text = await self.stt.final()
                    if not item.done():  # not given up on (a reply cancelled as the connection closed)
                        item.set_result(text)
                else:
                    await self.stt.push(item)
            except Exception as e:
                if isinstance(item, asyncio.Future) and not item.done():
                    item.set_exception(e)  # the reply waiting on it tells its client
                if failed is None:  # its decoder's state is gone: the conversation ends, the client may reconnect
                    log.exception("speech-to-text failed")
                    with contextlib.suppress(ConnectionClosed):
                        await self.conn.send_error("speech-to-text failed: the conversation is closed")
                        await self.conn.close(1011, "speech-to-text failed")
                failed = e

    async def _reply_or_error(self, endpoint: float) -> None:
        """`_reply`, with any failure told to the client and logged rather than lost in a task."""
        try:
            await self._reply(endpoint)
        except (asyncio.CancelledError, ConnectionClosed):
            raise
        except Exception:
            log.exception("cascade reply failed")
            with contextlib.suppress(ConnectionClosed):
                await self.conn.send_error("reply failed")

    async def _reply(self, endpoint: float) -> None:
        """STT final search, the text decoder's reply streamed into phrases, each phrase spoken as it is ready."""
        times = {"endpoint": endpoint}
        final = asyncio.get_running_loop().create_future()
        self.stt_in.put_nowait(final)
        text = await final
        times["stt_done"] = time.perf_counter()
        engine = self.server.text_engine
        data = np.frombuffer((text or " ").encode(), dtype=np.uint8).astype(np.int64)[None]  # never an empty prompt
        engine.push_codes(self.text_cid, data)
        engine.end_turn(self.text_cid)
        phrases: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(phrases, times, text))
        try:
            pending, spoken = "", 0
            async for event in events(engine.event_queue(self.text_cid), self.conn):
                if isinstance(event, CodesEvent):
                    times.setdefault("llm_first_token", time.perf_counter())
                    pending += printable(event.codes[0])
                    while (cut := split_phrase(pending, 1 if spoken == 0 else PHRASE_CHARS)) is not None:
                        phrase, pending = cut
                        times.setdefault("phrase_ready", time.perf_counter())
                        await phrases.put(phrase)
                        spoken += 1
                elif isinstance(event, MetaEvent) and event.data.get("event") == "reply_done":
                    break
            if pending.strip():
                times.setdefault("phrase_ready", time.perf_counter())
                await phrases.put(pending.strip())
            await phrases.put(None)
            await speaker
        finally:
            speaker.cancel()

    async def _speak(self, phrases: asyncio.Queue, times: dict, text: str) -> None:
        first = True
        spoken = []
        while (phrase := await phrases.get()) is not None:
            spoken.append(phrase)
            voice = self._espeak(phrase) if self.tts == "espeak" else self._engine_tts(phrase)
            async for pcm in voice:
                times.setdefault("tts_first_audio", time.perf_counter())
                if await self.conn.send_audio(pcm, self.turns) and first:
                    times["sent"] = time.perf_counter()
                    first = False
                    meta = {"event": "first_audio", "turn": self.turns, "times": times, "stt_text": text}
                    await self.conn.send_event({**meta, "first_phrase": phrase})
        await self.conn.send_event({"event": "reply_done", "turn": self.turns, "reply_text": " ".join(spoken)})
        self.turns += 1

    @staticmethod
    async def _espeak(phrase: str) -> AsyncIterator[np.ndarray]:
        yield await asyncio.to_thread(synthesize, phrase)

    async def _engine_tts(self, phrase: str) -> AsyncIterator[np.ndarray]:
        """The phrase's bytes as the speech model's user stream (every codebook), a turn reply a character's
        frames (`CHARS_PER_S`) a character long."""
        engine, cid = self.server.engine, self.speech_cid
        codes = np.frombuffer(phrase.encode(), dtype=np.uint8).astype(np.int64)
        engine.push_codes(cid, np.repeat(codes[None], engine.model.config.num_codebooks, axis=0))
        engine.end_turn(cid)
        frame_size = engine.cfg.frame_size
        target, got, turn = max(1, round(len(phrase) / CHARS_PER_S / engine.cfg.frame_s)), 0, None
        async for event in events(engine.event_queue(cid), self.conn):
            if event.turn <= self.speech_turn:
                continue  # a turn already over (a late reply_done)
            turn = event.turn
            if isinstance(event, AudioEvent):
                take = min(len(event.pcm) // frame_size, target - got)
                got += take
                yield event.pcm[: take * frame_size]
                if got >= target:
                    engine.interrupt(cid, target)
                    break
            elif isinstance(event, MetaEvent) and event.data.get("event") == "reply_done":
                break
        if turn is not None:
            self.speech_turn = turn
