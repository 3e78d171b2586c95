"""Moshi's protocol on the connection core: `MoshiWire` (kind bytes, `server/protocol.py`; audio in Ogg/Opus or
PCM16) and `MoshiEndpoint` (/api/chat: a conversation in the engine, chosen by query parameters; a Moshi client
connects with none: duplex, Ogg/Opus)."""

from __future__ import annotations

import numpy as np
import sphn

from codec.tokenizer import SAMPLE_RATE
from s2s import Engine, SamplingParams
from server import protocol
from server.connection import Audio, Connection, EndTurn, Opener
from server.protocol import BLOCK, Control, Kind, ProtocolError
from server.session import EngineSession
from server.vad import VadConfig


class MoshiWire:
    def __init__(self, codec: str):
        if codec not in ("opus", "pcm16"):
            raise ProtocolError(f"codec must be opus or pcm16, got {codec!r}")
        self.codec = codec
        self.opus_in = sphn.OpusStreamReader(SAMPLE_RATE) if codec == "opus" else None
        self.opus_out = sphn.OpusStreamWriter(SAMPLE_RATE) if codec == "opus" else None

    def handshake(self) -> bytes:
        return protocol.handshake()

    def opened(self, info: dict) -> bytes:
        return protocol.metadata({**info, "codec": self.codec})

    def parse(self, message: bytes | str) -> Audio | EndTurn | None:
        kind, payload = protocol.parse(message)
        if kind is Kind.AUDIO:
            return Audio(self._decode(payload))
        if kind is Kind.CONTROL and payload[0] == Control.END_TURN:
            return EndTurn()
        return None  # other kinds (text, ping, unknown) are discarded

    def audio(self, pcm: np.ndarray) -> list[bytes]:
        """In 80 ms messages, as clients send theirs."""
        messages = []
        for a in range(0, len(pcm), BLOCK):
            block = pcm[a : a + BLOCK]
            data = self.opus_out.append_pcm(block) if self.opus_out else (block * 32767).astype("<i2").tobytes()
            if len(data):
                messages.append(protocol.audio(bytes(data)))
        return messages

    def event(self, data: dict) -> bytes:
        return protocol.metadata(data)

    def error(self, text: str) -> bytes:
        return protocol.error(text)

    def _decode(self, payload: bytes) -> np.ndarray:
        if self.opus_in is None:
            if len(payload) % 2:
                raise ProtocolError("audio payload is not valid PCM16")
            return np.frombuffer(payload, dtype="<i2").astype(np.float32) / 32768.0
        try:
            return np.asarray(self.opus_in.append_bytes(payload), dtype=np.float32).reshape(-1)
        except Exception as e:  # sphn raises its own errors on broken streams
            raise ProtocolError("audio payload is not valid Ogg/Opus") from e


class MoshiEndpoint:
    """Query parameters: `mode=duplex|turn`, `codec=opus|pcm16`, `voice=NAME`, and sampling (`sampling_of`)."""

    def __init__(self, engine: Engine, vad: VadConfig):
        self.engine, self.vad = engine, vad

    def error(self, text: str) -> bytes:
        return protocol.error(text)

    def accept(self, query: dict[str, str]) -> tuple[MoshiWire, Opener]:
        mode = query.get("mode", "duplex")
        if mode not in ("duplex", "turn"):
            raise ProtocolError(f"mode must be duplex or turn, got {mode!r}")
        wire = MoshiWire(query.get("codec", "opus"))
        voice = query.get("voice")
        if voice is not None and (not voice.isidentifier() or voice not in self.engine.voices):
            raise ProtocolError(f"unknown voice {voice!r}; voices are plain names: {sorted(self.engine.voices)}")
        sampling = sampling_of(query)

        def open_session(conn: Connection):
            return EngineSession.open(self.engine, conn, mode, voice, sampling, self.vad)

        return wire, open_session


def sampling_of(query: dict[str, str]) -> SamplingParams:
    """`temperature`, `top_k`, `top_p`, `seed`, also under the Moshi client's names (`audio_temperature`, ...)."""

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
        return SamplingParams(**kw)
    except ValueError as e:  # in range: temperature >= 0, top_k >= 0, 0 < top_p <= 1
        raise ProtocolError(str(e)) from e
