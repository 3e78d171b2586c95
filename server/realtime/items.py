"""A Realtime conversation's items and responses, the objects each dialect shows of them, and the checks on the
client events that make or cut them (`response.create`, `conversation.item.truncate`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from codec.pcm import SAMPLE_RATE
from server.moshi.protocol import ProtocolError

RESPONSE_FIELDS = {"metadata", "output_modalities", "modalities", "instructions", "conversation", "voice"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def ms(samples: int) -> int:
    return samples * 1000 // SAMPLE_RATE


@dataclass
class Item:
    id: str
    role: str  # "user" or "assistant"
    samples: int = 0  # its audio: appended (user), sent (assistant)
    turn: int | None = None  # the engine's turn it is in (a user item's comes with its `committed` event)
    status: str = "completed"
    transcript: str | None = None  # what it says, where the model has a text stream (an assistant item's)

    def view(self) -> dict:
        content = "input_audio" if self.role == "user" else "output_audio"
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": self.role,
            "status": self.status,
            "content": [{"type": content, "transcript": self.transcript}],
        }


@dataclass
class Response:
    id: str
    item: Item  # the assistant item it makes
    answers: Item | None  # the user item it answers; None: a voice prompt's first words (the engine's turn 0)
    metadata: dict | None
    times: dict | None = None  # the engine's stage times, once it is done

    @property
    def turn(self) -> int | None:
        """The engine turn whose reply it is, once known (its user item's `committed` event says)."""
        return self.answers.turn if self.answers is not None else 0

    def ids(self) -> dict:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    def view(self, status: str, beta: bool, reason: str | None = None, error: dict | None = None) -> dict:
        done = status != "in_progress"
        details = {"type": status, "reason": reason, **({"error": error} if error else {})} if done else None
        return {
            "id": self.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": [self.item.view()] if done else [],
            "metadata": self.metadata,
            ("modalities" if beta else "output_modalities"): ["audio"],
            "usage": None,
        }


def check_response(params: object) -> None:
    """`response.create`'s `response`, or a `ProtocolError` naming what of it this server cannot do."""
    if not isinstance(params, dict):
        raise ProtocolError("response: must be an object", "invalid_response")
    if unknown := set(params) - RESPONSE_FIELDS:
        raise ProtocolError(f"response: unknown or unsupported fields {sorted(unknown)}", "invalid_response")
    for key, ok in (("output_modalities", ["audio"]), ("modalities", ["audio", "text"]), ("conversation", "auto")):
        if key in params and params[key] not in (ok, None, ["audio"]):
            raise ProtocolError(f"response.{key}: {params[key]!r} is not supported", "invalid_response")
    if params.get("instructions") or params.get("voice"):
        raise ProtocolError("response: instructions and voice are not supported per response", "invalid_response")


def truncation_end(item: Item, event: dict) -> int:
    """Where `conversation.item.truncate` cuts `item`: its `audio_end_ms`, checked."""
    end = event.get("audio_end_ms")
    if item.role != "assistant":
        raise ProtocolError("only assistant items can be truncated", "invalid_value")
    if event.get("content_index", 0) != 0:
        raise ProtocolError("content_index must be 0: an item holds one audio part", "invalid_value")
    if not isinstance(end, int) or isinstance(end, bool) or end < 0:
        raise ProtocolError(f"audio_end_ms must be a whole number of ms >= 0, got {end!r}", "invalid_value")
    if end > ms(item.samples):
        raise ProtocolError(f"audio_end_ms {end} is past the item's audio ({ms(item.samples)} ms)", "invalid_value")
    return end
