"""RealtimeEndpoint: /v1/realtime. Query `model=` (any, or the server's `--served-model-name`) and `voice=` (a voice
prompt's name, as `session.update` sets it; in the URL, `s2s cluster` places the conversation by it); the header
`OpenAI-Beta: realtime=v1` picks the beta's event names. Authentication is `refusal`'s (`server/app.py`), before
the upgrade: `Authorization: Bearer TOKEN`, as the SDKs send it. A model with a text stream (Moshi's family) serves
duplex conversations only: its sessions are `DuplexSession`s (`duplex.py`), the others `RealtimeSession`s (turns)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from websockets.datastructures import Headers

from server.connection import Connection, Opener
from server.moshi.protocol import ProtocolError
from server.realtime.duplex import DuplexSession
from server.realtime.session import RealtimeSession
from server.realtime.wire import RealtimeWire
from server.turn_metrics import TurnMetrics
from server.vad.config import Gate, VadConfig

if TYPE_CHECKING:
    from s2s import Engine

DEFAULT_MODEL = "s2s"  # the model name shown when the client names none


class RealtimeEndpoint:
    def __init__(self, engine: Engine, vad: VadConfig, gate: Gate, served_model_name: str | None, metrics: TurnMetrics):
        self.engine, self.vad, self.gate, self.metrics = engine, vad, gate, metrics
        self.served_model_name = served_model_name

    def error(self, text: str) -> str:
        return RealtimeWire(beta=False).error(text)

    def accept(self, query: dict[str, str], headers: Headers) -> tuple[RealtimeWire, Opener]:
        model = query.get("model", self.served_model_name or DEFAULT_MODEL)
        if self.served_model_name is not None and model != self.served_model_name:
            raise ProtocolError(f"unknown model {model!r}: this server serves {self.served_model_name!r}")
        voice = query.get("voice")
        if voice is not None and voice not in self.engine.voices:
            raise ProtocolError(f"unknown voice {voice!r}; voices: {sorted(self.engine.voices)}")
        kind = RealtimeSession
        if self.engine.model.config.text_stream:
            if getattr(self.engine.model, "text_pieces", None) is None:  # (what its responses are cut by)
                raise ProtocolError("this server has no tokenizer for the model's text stream")
            kind = DuplexSession
        wire = RealtimeWire(beta="realtime=v1" in headers.get("OpenAI-Beta", ""))

        async def open_session(conn: Connection) -> RealtimeSession:
            session = await kind.open(self.engine, conn, self.vad, self.gate, model, self.metrics, voice)
            self.metrics.opened("realtime")
            return session

        return wire, open_session
