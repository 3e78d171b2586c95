"""CascadeServer: a cascaded STT -> LLM -> TTS pipeline behind the same websocket protocol as `server/app.py` in turn
mode, built from real parts, as the baseline `s2s bench cascade` measures this server against.

Stages of one turn, each stamped (`time.perf_counter`, the same monotonic clock as the engines') into the metadata
message sent right after the first reply audio:

- endpointing: `server/vad.py`'s `Endpointer`, the turn mode's settings except `silence_ms` (a query parameter);
- speech-to-text: pocketsphinx (`server/stt.py`) in worker processes, fed while the user speaks; at the endpoint only
  its final search is left. Accuracy on espeak-ng voices is poor; what is measured is latency;
- text decoder: `S2SModel` with one codebook of 256 bytes, the speech model's size, served by a codec-free `Engine`;
  the transcript goes in as the user stream, the reply streams out token by token (`--max-reply-frames` / 5 bytes:
  about 15 characters a second of speech). Random weights give random bytes: each becomes a letter, or a space one
  time in six (words of about five letters);
- phrase aggregation, pipecat-style: the first phrase goes to speech at the first word boundary, later ones at the
  first word boundary after `PHRASE_CHARS` characters, the rest when the reply ends;
- text-to-speech (`tts=espeak|engine`): espeak-ng, or the speech `S2SModel` served by a second `Engine` with the
  codec, the phrase's bytes as its user stream (both codebooks), generating codes turned into audio by the streaming
  decoder; once it has made `FRAMES_PER_CHAR` frames a character, the reply is cut (`interrupt`).

Admission: a connection is refused (1013) when speech-to-text could not take another stream in real time
(`SttWorkers.open`) or when an engine refuses it, so that the cascade serves the conversations it admits at its
best rather than all of them late.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus

import numpy as np
import sphn
import torch
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from codec.tokenizer import SAMPLE_RATE
from s2s import AudioEvent, Engine, EngineConfig, MetaEvent, ModelConfig, Refused, S2SModel, SamplingParams
from s2s.engine import CodesEvent
from server import protocol
from server.app import ChatServer
from server.audio import load_wav
from server.client import BLOCK  # audio goes out in 80 ms messages, as clients send it
from server.protocol import Control, Kind, ProtocolError
from server.speech import SAMPLE_PATH, synthesize
from server.stt import AtCapacity, SttStream, SttWorkers, default_workers
from server.vad import Endpointer, VadConfig

log = logging.getLogger("s2s.cascade")
CHARS_PER_S = 15.0
FRAMES_PER_CHAR = 75 / CHARS_PER_S
PHRASE_CHARS = 20
LETTERS = "etaoinshrdlucmfwypvbgkjqxz"


def printable(ids: np.ndarray) -> str:
    """Bytes from the text decoder as speakable text: a space one time in six (and for non-byte ids), else a letter."""
    return "".join(" " if b >= 256 or b % 6 == 0 else LETTERS[b % 26] for b in ids.tolist())


def split_phrase(text: str, min_chars: int) -> tuple[str, str] | None:
    """(phrase, rest) at the first word boundary at or after `min_chars` characters of words, or None."""
    text = text.lstrip()
    i = text.find(" ", max(1, min_chars))
    return (text[:i], text[i + 1 :]) if i != -1 else None


def text_engine_for(
    preset: str,
    reply_frames: int,
    max_conversations: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **config,
) -> Engine:
    """The cascade's text decoder: the speech model's size and class, one codebook of bytes, no codec, replies as
    long in speech as `reply_frames` speech frames, on the speech model's device and dtype. One step a tick
    (13.3 ms): its earliest first token."""
    cfg = ModelConfig.preset(preset, num_codebooks=1, codebook_size=256)
    model = S2SModel.from_seed(cfg, seed=0, dtype=dtype, device=device)
    reply_bytes = max(1, round(reply_frames / FRAMES_PER_CHAR))
    engine_cfg = EngineConfig(
        frames_per_tick=1, max_reply_frames=reply_bytes, max_conversations=max_conversations, **config
    )
    return Engine(model, None, engine_cfg)


@dataclass
class _Connection:
    ws: ServerConnection
    codec: str
    tts: str
    text_cid: str
    speech_cid: str | None
    stt: SttStream
    opus: sphn.OpusStreamWriter | None
    stt_in: asyncio.Queue  # PCM blocks to transcribe, or a future to resolve with the final transcript
    turns: int = 0
    speech_turn: int = -1  # the speech engine's last finished turn

    async def send_audio(self, pcm: np.ndarray) -> bool:
        """Send PCM in 80 ms messages; True once any bytes went out."""
        sent = False
        for a in range(0, len(pcm), BLOCK):
            block = np.clip(pcm[a : a + BLOCK], -1, 1)
            data = self.opus.append_pcm(block) if self.opus else (block * 32767).astype("<i2").tobytes()
            if len(data):
                await self.ws.send(protocol.audio(bytes(data)))
                sent = True
        return sent


async def _events(engine: Engine, cid: str) -> AsyncIterator:
    """A conversation's engine events, read off the event loop, until it is closed."""
    q = engine.event_queue(cid)
    while (event := await asyncio.to_thread(q.get)) is not None:
        yield event


class CascadeServer:
    def __init__(
        self,
        text_engine: Engine,
        speech_engine: Engine,
        host: str = "127.0.0.1",
        port: int = 8998,
        vad: VadConfig | None = None,
        stt_workers: int | None = None,
    ):
        self.text_engine, self.speech_engine = text_engine, speech_engine
        self.host, self.port, self.vad = host, port, vad or VadConfig()
        self.stt = SttWorkers(
            default_workers() if stt_workers is None else stt_workers,
            text_engine.cfg.admission_headroom,
            text_engine.cfg.max_conversations,
        )
        self._server: Server | None = None

    async def start(self) -> int:
        self.text_engine.start()
        self.speech_engine.start()
        await self.stt.start(load_wav(SAMPLE_PATH))  # calibrated beside the running engines
        self._server = await serve(self._chat, self.host, self.port, process_request=self._http, ping_interval=20)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await asyncio.to_thread(self.text_engine.stop)
        await asyncio.to_thread(self.speech_engine.stop)
        await asyncio.to_thread(self.stt.shutdown)

    def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.partition("?")[0]
        if path == "/healthz":
            return connection.respond(HTTPStatus.OK, "ok\n")
        return None if path == "/api/chat" else connection.respond(HTTPStatus.NOT_FOUND, "not found\n")

    async def _chat(self, ws: ServerConnection) -> None:
        query = {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(ws.request.path).query).items()}
        try:
            if query.get("mode", "turn") != "turn":
                raise ProtocolError("the cascade has turn mode only (mode=turn)")
            codec, tts = query.get("codec", "opus"), query.get("tts", "espeak")
            if codec not in ("opus", "pcm16"):
                raise ProtocolError(f"codec must be opus or pcm16, got {codec!r}")
            if tts not in ("espeak", "engine"):
                raise ProtocolError(f"tts must be espeak or engine, got {tts!r}")
            silence_ms = float(query.get("silence_ms", self.vad.silence_s * 1000))
            if not 0 < silence_ms <= 5000:
                raise ProtocolError(f"silence_ms must be in (0, 5000], got {silence_ms}")
            sampling = SamplingParams(seed=int(query.get("seed", 0)))
        except (ProtocolError, ValueError) as e:
            await ws.send(protocol.error(str(e)))
            await ws.close(1008, "bad request")
            return
        await ws.send(protocol.handshake())
        opened: list[tuple[Engine, str]] = []
        stt: SttStream | None = None
        try:
            stt = self.stt.open()  # first, and before any await: connections arriving together see each other's
            opened.append((self.text_engine, await asyncio.to_thread(self.text_engine.open, "turn", sampling=sampling)))
            if tts == "engine":
                cid = await asyncio.to_thread(self.speech_engine.open, "turn", sampling=sampling)
                opened.append((self.speech_engine, cid))
        except BaseException as e:  # a refusal, or anything else: what was opened is given back
            for engine, cid in opened:
                await asyncio.to_thread(engine.close, cid)
            if stt is not None:
                await stt.close()
            if not isinstance(e, (AtCapacity, Refused)):
                raise
            await ws.send(protocol.error(f"refused: {e}"))
            await ws.close(1013, "try again later")
            return
        conn = _Connection(
            ws,
            codec,
            tts,
            opened[0][1],
            opened[1][1] if tts == "engine" else None,
            stt,
            sphn.OpusStreamWriter(SAMPLE_RATE) if codec == "opus" else None,
            asyncio.Queue(),
        )
        vad_cfg = VadConfig(self.vad.start_threshold, self.vad.stop_threshold, silence_ms / 1000)
        reply: asyncio.Task | None = None
        transcriber = asyncio.create_task(self._transcribe(conn))
        try:
            await ws.send(protocol.metadata({"session": conn.text_cid, "mode": "turn", "codec": codec, "tts": tts}))
            opus_in = sphn.OpusStreamReader(SAMPLE_RATE) if codec == "opus" else None
            vad: Endpointer | None = None
            async for message in ws:
                try:
                    kind, payload = protocol.parse(message)
                except ProtocolError as e:
                    await ws.send(protocol.error(str(e)))
                    continue
                endpoint = None
                if kind is Kind.AUDIO:
                    pcm = ChatServer._decode_audio(payload, opus_in)
                    if pcm is None:
                        await ws.send(protocol.error("audio payload is not valid " + codec))
                        continue
                    if vad is None:
                        vad = await asyncio.to_thread(Endpointer, vad_cfg)
                    conn.stt_in.put_nowait(pcm)
                    if "end_of_turn" in await asyncio.to_thread(vad.push, pcm):
                        endpoint = time.perf_counter()
                elif kind is Kind.CONTROL and payload[0] == Control.END_TURN:
                    endpoint = time.perf_counter()
                if endpoint is not None and (reply is None or reply.done()):
                    reply = asyncio.create_task(self._reply_or_error(conn, endpoint))
        except ConnectionClosed:
            pass
        finally:
            if reply is not None:
                reply.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                    await reply
            conn.stt_in.put_nowait(None)  # the transcriber ends after what it holds: its decoder is then free
            await transcriber
            for engine, cid in opened:
                await asyncio.to_thread(engine.close, cid)
            await stt.close()

    @staticmethod
    async def _transcribe(conn: _Connection) -> None:
        """Speech-to-text beside endpointing (as pipecat runs its STT service): blocks in arrival order; a future
        asks for the final transcript of everything before it; None ends it. A failure closes the connection."""
        failed: Exception | None = None  # once the recognizer fails, every later transcript request gets the error
        while (item := await conn.stt_in.get()) is not None:
            try:
                if failed is not None:
                    raise failed
                if isinstance(item, asyncio.Future):
                    text = await conn.stt.final()
                    if not item.done():  # not given up on (a reply cancelled as the connection closed)
                        item.set_result(text)
                else:
                    await conn.stt.push(item)
            except Exception as e:
                if isinstance(item, asyncio.Future) and not item.done():
                    item.set_exception(e)  # the reply waiting on it tells its client
                if failed is None:  # its decoder's state is gone: the conversation ends, the client may reconnect
                    log.exception("speech-to-text failed")
                    with contextlib.suppress(ConnectionClosed):
                        await conn.ws.send(protocol.error(f"speech-to-text failed: {type(e).__name__}: {e}"))
                        await conn.ws.close(1011, "speech-to-text failed")
                failed = e

    async def _reply_or_error(self, conn: _Connection, endpoint: float) -> None:
        """`_reply`, with any failure told to the client (0x05) and logged rather than lost in a task."""
        try:
            await self._reply(conn, endpoint)
        except (asyncio.CancelledError, ConnectionClosed):
            raise
        except Exception as e:
            log.exception("cascade reply failed")
            with contextlib.suppress(ConnectionClosed):
                await conn.ws.send(protocol.error(f"reply failed: {type(e).__name__}: {e}"))

    async def _reply(self, conn: _Connection, endpoint: float) -> None:
        """STT final search, the text decoder's reply streamed into phrases, each phrase spoken as it is ready."""
        times = {"endpoint": endpoint}
        final = asyncio.get_running_loop().create_future()
        conn.stt_in.put_nowait(final)
        text = await final
        times["stt_done"] = time.perf_counter()
        data = np.frombuffer((text or " ").encode(), dtype=np.uint8).astype(np.int64)[None]  # never an empty prompt
        self.text_engine.push_codes(conn.text_cid, data)
        await asyncio.to_thread(self.text_engine.end_turn, conn.text_cid)
        phrases: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(conn, phrases, times, text))
        try:
            pending, spoken = "", 0
            async for event in _events(self.text_engine, conn.text_cid):
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

    async def _speak(self, conn: _Connection, phrases: asyncio.Queue, times: dict, text: str) -> None:
        first = True
        spoken = []
        while (phrase := await phrases.get()) is not None:
            spoken.append(phrase)
            voice = self._espeak(phrase) if conn.tts == "espeak" else self._engine_tts(conn, phrase)
            async for pcm in voice:
                times.setdefault("tts_first_audio", time.perf_counter())
                if await conn.send_audio(pcm) and first:
                    times["sent"] = time.perf_counter()
                    first = False
                    meta = {"event": "first_audio", "turn": conn.turns, "times": times, "stt_text": text}
                    await conn.ws.send(protocol.metadata({**meta, "first_phrase": phrase}))
        await conn.ws.send(
            protocol.metadata({"event": "reply_done", "turn": conn.turns, "reply_text": " ".join(spoken)})
        )
        conn.turns += 1

    @staticmethod
    async def _espeak(phrase: str) -> AsyncIterator[np.ndarray]:
        yield await asyncio.to_thread(synthesize, phrase)

    async def _engine_tts(self, conn: _Connection, phrase: str) -> AsyncIterator[np.ndarray]:
        """The phrase's bytes as the speech model's user stream (every codebook), a turn reply `FRAMES_PER_CHAR`
        frames a character long."""
        engine, cid = self.speech_engine, conn.speech_cid
        codes = np.frombuffer(phrase.encode(), dtype=np.uint8).astype(np.int64)
        engine.push_codes(cid, np.repeat(codes[None], engine.model.config.num_codebooks, axis=0))
        await asyncio.to_thread(engine.end_turn, cid)
        target, got, turn = max(1, round(len(phrase) * FRAMES_PER_CHAR)), 0, None
        async for event in _events(engine, cid):
            if event.turn <= conn.speech_turn:
                continue  # a turn already over (a late reply_done)
            turn = event.turn
            if isinstance(event, AudioEvent):
                take = min(len(event.pcm) // 320, target - got)
                got += take
                yield event.pcm[: take * 320]
                if got >= target:
                    await asyncio.to_thread(engine.interrupt, cid, target)
                    break
            elif isinstance(event, MetaEvent) and event.data.get("event") == "reply_done":
                break
        if turn is not None:
            conn.speech_turn = turn
