"""The Realtime API's framing on the connection core: JSON events in text frames, audio as base64 pcm16 at 24 kHz.

`parse` turns `input_audio_buffer.append` into `Audio` (paced and endpointed by the core like any audio) and every
other client event this server knows into a `Request` for the session, at its cost (`COSTS`); the rest is an error
event naming it. Out, every event gets an `event_id`, reply audio is a `response.output_audio.delta` of the response
in `reply`, and a beta client (`OpenAI-Beta: realtime=v1`) gets the beta names."""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import math

import numpy as np

from codec.pcm import SAMPLE_RATE, from_pcm16, to_pcm16
from server.moshi.protocol import ProtocolError
from server.protocols import Audio, Request

CLIENT_EVENTS = {
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "conversation.item.retrieve",
    "conversation.item.truncate",
    "conversation.item.delete",
    "response.create",
    "response.cancel",
    "output_audio_buffer.clear",
}
# What an event costs of the connection's message pace (`Request.cost`; the others cost 1, an append's audio and
# bytes being paced besides): about what it makes the server do. A truncation or a deletion makes the engine compute
# the conversation after the edit again, a response makes it reply: ten of these a second at the default 100 messages
# (an honest client sends one a turn). A session.update is checked and answered on the event loop in about what an
# append takes there (its VAD settings are thresholds: `Endpointer.configure`); a new voice, which opens a new
# conversation in the engine, is rate-limited by the session (`VOICE_INTERVAL_S`).
COSTS = {
    "conversation.item.truncate": 10,
    "conversation.item.delete": 10,
    "response.create": 10,
}
# GA names the beta spells otherwise (the rest are the same in both).
BETA_NAMES = {
    "conversation.item.added": "conversation.item.created",
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
}
BETA_CONTENT = {"output_audio": "audio"}
GA_ONLY = {"conversation.item.done"}  # events the beta does not have: a beta client is not sent them


def pcm16_base64(pcm: np.ndarray) -> str:
    return base64.b64encode(to_pcm16(pcm)).decode()


class RealtimeWire:
    audio_bytes_per_s = math.ceil(2 * SAMPLE_RATE * 4 / 3)  # pcm16 in base64
    framing_bytes = 200  # an append's JSON around its audio (an event_id, the type), generously

    def __init__(self, beta: bool):
        self.beta = beta
        self.reply: dict | None = None  # the response whose audio goes out now: its ids, for each delta
        self._ids = itertools.count(1)

    def handshake(self) -> None:
        return None

    def opened(self, info: dict) -> str:
        return self.event({"type": "session.created", "session": info})

    def parse(self, message: bytes | str) -> Audio | Request:
        if isinstance(message, bytes):
            raise ProtocolError("binary frames are not part of the Realtime API: send JSON events as text")
        try:
            event = json.loads(message)
        except (ValueError, RecursionError) as e:  # (a number of over 4,300 digits, or nesting past the stack)
            raise ProtocolError(f"not valid JSON: {str(e)[:200]}", "invalid_json") from e
        kind = event.get("type") if isinstance(event, dict) else None
        if not isinstance(kind, str):
            raise ProtocolError("an event is a JSON object with a string 'type'", "invalid_event")
        if kind not in CLIENT_EVENTS:
            raise ProtocolError(f"unknown event type {kind!r}", "unknown_event")
        if kind != "input_audio_buffer.append":
            return Request(event, COSTS.get(kind, 1))
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise ProtocolError("input_audio_buffer.append needs 'audio': base64 pcm16", "invalid_audio")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ProtocolError(f"'audio' is not valid base64: {e}", "invalid_audio") from e
        if len(data) % 2:
            raise ProtocolError("'audio' is not pcm16: an odd number of bytes", "invalid_audio")
        return Audio(from_pcm16(data))

    def audio(self, pcm: np.ndarray) -> list[str]:
        """`pcm` of the response in `reply`, as one delta."""
        return [self.event({"type": "response.output_audio.delta", **self.reply, "delta": pcm16_base64(pcm)})]

    def event(self, data: dict) -> str:
        data = {"event_id": f"event_{next(self._ids)}", **data}
        if self.beta:
            data["type"] = BETA_NAMES.get(data["type"], data["type"])
            items = [data.get("item", {}), *data.get("response", {}).get("output", [])]
            for content in (c for item in items for c in item.get("content", [])):
                content["type"] = BETA_CONTENT.get(content["type"], content["type"])
        return json.dumps(data)

    def error(self, text: str, code: str = "invalid_request") -> str:
        kind = "server_error" if code in ("refused", "engine_error") else "invalid_request_error"
        return self.event({"type": "error", "error": {"type": kind, "code": code, "message": text, "param": None}})
