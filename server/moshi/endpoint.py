"""Moshi's protocol on the connection core: `MoshiWire` (kind bytes, `server/moshi/protocol.py`; audio in Ogg/Opus or
PCM16) and `MoshiEndpoint` (/api/chat: a conversation in the engine, chosen by query parameters; a Moshi client
connects with none: duplex, Ogg/Opus)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import sphn
from websockets.datastructures import Headers

from codec.pcm import SAMPLE_RATE, from_pcm16, to_pcm16
from s2s import SamplingParams
from server.connection import Connection, Opener
from server.engine_session import EngineSession
from server.moshi import protocol
from server.moshi.ogg_opus import OggOpusWriter
from server.moshi.protocol import BLOCK, Control, Kind, ProtocolError, StreamError
from server.protocols import Audio, EndTurn, Stream
from server.turn_metrics import TurnMetrics
from server.vad.config import Gate, VadConfig

if TYPE_CHECKING:
    from s2s import Engine

STREAM_CONTROLS = {Control.START: "start", Control.PAUSE: "pause", Control.RESTART: "restart"}


class MoshiWire:
    audio_bytes_per_s = 2 * SAMPLE_RATE  # pcm16 (Opus is less)
    framing_bytes = 1  # the kind byte
    # Bytes the Opus reader may take without giving audio before it is reset. A real client's page is ~300 bytes
    # (80 ms); the largest Ogg page is 65,307. sphn keeps what it cannot use: a packet that never ends, and every
    # byte after a parse error.
    MAX_OPUS_PENDING = 64 << 10
    MAX_UNDECODED = 256 << 10  # Ogg/Opus bytes with no audio out, across resets: past this, not a stream at all

    def __init__(self, codec: str):
        if codec not in ("opus", "pcm16"):
            raise ProtocolError(f"codec must be opus or pcm16, got {codec!r}")
        self.codec = codec
        self.opus_in = sphn.OpusStreamReader(SAMPLE_RATE) if codec == "opus" else None
        self.opus_pending = 0  # bytes fed to `opus_in` since it last gave audio: what it may be holding
        self.undecoded = 0  # bytes since the last audio, resets included
        self.opus_out = OggOpusWriter(SAMPLE_RATE) if codec == "opus" else None

    def handshake(self) -> bytes:
        return protocol.handshake()

    def opened(self, info: dict) -> bytes:
        return protocol.metadata({**info, "codec": self.codec})

    def parse(self, message: bytes | str) -> Audio | EndTurn | Stream | None:
        kind, payload = protocol.parse(message)
        if kind is Kind.AUDIO:
            return Audio(self._decode(payload))
        if kind is Kind.CONTROL and payload[0] == Control.END_TURN:
            return EndTurn()
        if kind is Kind.CONTROL and payload[0] in STREAM_CONTROLS:
            return Stream(STREAM_CONTROLS[payload[0]])
        return None  # other kinds (text, ping, unknown) are discarded

    def audio(self, pcm: np.ndarray) -> list[bytes]:
        """In 80 ms messages, as clients send theirs."""
        messages = []
        for a in range(0, len(pcm), BLOCK):
            block = pcm[a : a + BLOCK]
            data = self.opus_out.append_pcm(block) if self.opus_out else to_pcm16(block)
            if len(data):
                messages.append(protocol.audio(bytes(data)))
        return messages

    def text(self, piece: str) -> bytes:
        return protocol.text(piece)

    def event(self, data: dict) -> bytes:
        return protocol.metadata(data)

    def error(self, text: str, code: str = "invalid_request") -> bytes:
        return protocol.error(text)

    def _decode(self, payload: bytes) -> np.ndarray:
        if self.opus_in is None:
            if len(payload) % 2:
                raise ProtocolError("audio payload is not valid PCM16")
            return from_pcm16(payload)
        self.opus_pending += len(payload)
        self.undecoded += len(payload)
        if self.undecoded > self.MAX_UNDECODED:
            raise StreamError(f"no audio in over {self.MAX_UNDECODED} bytes of Ogg/Opus: closed")
        try:
            pcm = np.asarray(self.opus_in.append_bytes(payload), dtype=np.float32).reshape(-1)
            pcm = np.clip(pcm, -1, 1)  # a decoder overshoots full-scale input a little
        except Exception as e:  # sphn raises its own errors on broken streams
            self._reset_opus()
            raise ProtocolError("audio payload is not valid Ogg/Opus: the stream starts again") from e
        if len(pcm):
            self.opus_pending = self.undecoded = 0
        elif self.opus_pending > self.MAX_OPUS_PENDING:
            self._reset_opus()
            raise ProtocolError(f"no audio in over {self.MAX_OPUS_PENDING} bytes of Ogg/Opus: the stream starts again")
        return pcm

    def _reset_opus(self) -> None:
        """A fresh reader, the old one's buffer dropped: after a broken stream, a valid one decodes again."""
        self.opus_in, self.opus_pending = sphn.OpusStreamReader(SAMPLE_RATE), 0


class MoshiEndpoint:
    """Query parameters: `mode=duplex|turn`, `codec=opus|pcm16`, `voice=NAME`, and sampling (`sampling_of`)."""

    def __init__(self, engine: Engine, vad: VadConfig, gate: Gate, metrics: TurnMetrics):
        self.engine, self.vad, self.gate, self.metrics = engine, vad, gate, metrics

    def error(self, text: str) -> bytes:
        return protocol.error(text)

    def accept(self, query: dict[str, str], headers: Headers) -> tuple[MoshiWire, Opener]:
        mode = query.get("mode", "duplex")
        if mode not in ("duplex", "turn"):
            raise ProtocolError(f"mode must be duplex or turn, got {mode!r}")
        if mode == "turn" and self.engine.model.config.text_stream:
            raise ProtocolError("this model (with a text stream: Moshi's family) serves duplex conversations only")
        wire = MoshiWire(query.get("codec", "opus"))
        voice = query.get("voice")
        if voice is not None and (not voice.isidentifier() or voice not in self.engine.voices):
            raise ProtocolError(f"unknown voice {voice!r}; voices are plain names: {sorted(self.engine.voices)}")
        sampling = sampling_of(query, self.engine.model.config.codebook_size)

        async def open_session(conn: Connection) -> EngineSession:
            vad, gate, metrics = self.vad, self.gate, self.metrics
            session = await EngineSession.open(self.engine, conn, mode, voice, sampling, vad, gate, metrics)
            self.metrics.opened("moshi")
            return session

        return wire, open_session


def sampling_of(query: dict[str, str], vocab: int) -> SamplingParams:
    """`temperature`, `top_k` (at most `vocab`, the model's codebook size), `top_p`, `seed`, also under the Moshi
    client's names (`audio_temperature`, ...)."""

    def pick(*names: str) -> str | None:
        return next((query[n] for n in names if n in query), None)

    kw = {}
    for key, names, cast in (
        ("temperature", ("temperature", "audio_temperature"), float),
        ("top_k", ("top_k", "audio_topk"), int),
        ("top_p", ("top_p",), float),
        ("seed", ("seed", "audio_seed"), int),
    ):
        raw = pick(*names)
        if raw is not None:
            try:
                kw[key] = cast(raw)
            except ValueError as e:
                raise ProtocolError(f"bad {names[0]}={raw!r}: {e}") from e
    try:
        params = SamplingParams(**kw)
    except ValueError as e:  # in range: temperature >= 0, top_k >= 0, 0 < top_p <= 1
        raise ProtocolError(str(e)) from e
    if kw.get("top_k", 0) > vocab:  # a client's own: the default (250) over a smaller vocabulary cuts nothing
        raise ProtocolError(f"top_k must be at most {vocab}, the model's vocabulary, got {params.top_k}")
    return params
