"""The wire protocol: Moshi's framing (one kind byte, then the payload), shared by server and client."""

from __future__ import annotations

import enum
import json
import struct

PROTOCOL_VERSION = 0
MODEL_VERSION = 0
BLOCK = 1920  # samples of 24 kHz audio in one message: 80 ms, as Moshi's client sends


class Kind(enum.IntEnum):
    HANDSHAKE = 0
    AUDIO = 1
    TEXT = 2
    CONTROL = 3
    METADATA = 4
    ERROR = 5
    PING = 6


class Control(enum.IntEnum):
    START = 0
    END_TURN = 1
    PAUSE = 2
    RESTART = 3


class ProtocolError(ValueError):
    """A message that breaks the protocol; the text is what the client is told, `code` its kind (for protocols whose
    errors carry one: the Realtime API's)."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


class StreamError(ProtocolError):
    """Input the connection cannot go on from: the client is told, and the connection closes (1008)."""


def handshake() -> bytes:
    return bytes([Kind.HANDSHAKE]) + struct.pack("<II", PROTOCOL_VERSION, MODEL_VERSION)


def audio(payload: bytes) -> bytes:
    return bytes([Kind.AUDIO]) + payload


def text(piece: str) -> bytes:
    """Text of the model's text stream (Moshi's inner monologue), as Kyutai's server sends each step's piece."""
    return bytes([Kind.TEXT]) + piece.encode()


def metadata(data: dict) -> bytes:
    return (
        bytes([Kind.METADATA]) + json.dumps(data, default=lambda o: o.item() if hasattr(o, "item") else str(o)).encode()
    )


def metadata_of(message: bytes) -> dict:
    """Client side: the JSON of a metadata message."""
    return json.loads(message[1:].decode())


def error(message: str) -> bytes:
    return bytes([Kind.ERROR]) + message.encode()


def control(code: Control) -> bytes:
    return bytes([Kind.CONTROL, code])


def parse(message: bytes | str) -> tuple[Kind | None, bytes]:
    """(kind, payload); kind None for an unknown kind byte (to be discarded). Raises ProtocolError when malformed."""
    if isinstance(message, str):
        raise ProtocolError("text websocket frames are not part of the protocol: send binary messages")
    if not message:
        raise ProtocolError("empty message: every message starts with a kind byte")
    try:
        kind = Kind(message[0])
    except ValueError:
        return None, b""
    payload = bytes(message[1:])
    if kind is Kind.CONTROL:
        if len(payload) != 1 or payload[0] not in tuple(Control):
            raise ProtocolError(f"a control message holds one byte in 0..3, got {payload[:8]!r}")
    if kind is Kind.HANDSHAKE and len(payload) != 8:
        raise ProtocolError("a handshake holds two u32 values")
    return kind, payload
