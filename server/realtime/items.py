"""A Realtime conversation's items and responses, and the objects each dialect shows of them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from codec.pcm import SAMPLE_RATE


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

    def view(self) -> dict:
        content = "input_audio" if self.role == "user" else "output_audio"
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": self.role,
            "status": self.status,
            "content": [{"type": content, "transcript": None}],
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
