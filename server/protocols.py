"""What a protocol on the connection core (`server/connection.py`) provides: its framing (`Wire`), which parses each
client message into `Audio`, `EndTurn`, `Stream` or `Request`, and what answers the connection (`Session`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from server.vad.config import Gate, VadConfig

Message = bytes | str


@dataclass
class Audio:
    pcm: np.ndarray  # float32, 24 kHz


@dataclass
class EndTurn:
    """The user says they are done speaking (turn mode)."""


@dataclass
class Request:
    """A protocol's own request, for its session (`Session.request`): a Realtime API client event (`event["type"]`
    names it)."""

    event: dict
    cost: int = 1  # messages of the connection's pace it takes (`Limits.max_messages_per_s`): what it costs the server


@dataclass
class Stream:
    """The client starts, pauses or restarts the conversation's stream (Moshi's controls 0, 2 and 3)."""

    action: str  # "start", "pause" or "restart"


class Wire(Protocol):
    """One connection's framing: Moshi's kind bytes (`server/moshi/endpoint.py`), or the Realtime API's JSON events."""

    audio_bytes_per_s: float  # what real-time audio costs on this wire (pcm16, base64 pcm16): pacing's byte bound
    framing_bytes: int  # a message's bytes besides its audio, at most, for an honest client

    def handshake(self) -> Message | None: ...

    def opened(self, info: dict) -> Message: ...

    def parse(self, message: Message) -> Audio | EndTurn | Stream | Request | None:
        """What a client message asks for; None for one to ignore. Raises `ProtocolError` (told to the client)."""

    def audio(self, pcm: np.ndarray) -> list[Message]: ...

    def text(self, piece: str) -> Message:
        """Text of the model's text stream (Moshi's `0x02` message); only wires whose sessions send text have it."""

    def event(self, data: dict) -> Message: ...

    def error(self, text: str, code: str = "invalid_request") -> Message: ...


class Session(Protocol):
    """What answers a connection: a conversation in the engine (`server/engine_session.py`), or the cascade's
    pipeline."""

    info: dict  # told to the client once open (`Wire.opened`)
    vad: VadConfig | None  # endpointing on its audio (turn mode), or None; read before each slice of audio
    gate: Gate | None  # where its endpointer's turn ends go (the server's `TurnGate`), or None: all are answered

    async def barge_in(self, played_samples: int) -> None:
        """The VAD heard speech start: a barge-in where a reply plays (what the client heard of it, `played_samples`,
        stays)."""

    def audio(self, pcm: np.ndarray) -> None: ...

    async def end_turn(self) -> None:
        """The user is done: the VAD ended a turn worth a reply, or the client said so (`EndTurn`)."""

    async def speech_ended(self) -> None:
        """The VAD heard speech end that is no turn (short, unsure, or dropped by the `TurnGate`)."""

    async def request(self, request: Request) -> None:
        """A protocol's own request (only sessions whose wire makes them); raises `ProtocolError` (told)."""

    async def stream(self, action: str) -> None:
        """`Stream`'s action; raises `ProtocolError` where it is not supported."""

    async def close(self) -> None: ...
