"""RealtimeSession: the Realtime API's conversation (items and responses) over a turn-mode conversation in the engine
(a model with a text stream, which serves duplex only, has `duplex.py`'s `DuplexSession` instead).

The user's audio streams into the engine as it is appended, so its prefill is done by the end of the turn. A commit
(the server VAD's end of turn, or the client's) closes the engine's turn (`Engine.commit`), whose `committed` event
names the engine turn behind the user item; a response is the engine's reply to that turn (`Engine.end_turn`), its
audio sent as deltas while it is made. Cancelling a response, truncating an assistant item and deleting an item edit
the engine's context (`Engine.interrupt`, `Engine.remove`): it keeps what the user heard.

Known differences from OpenAI's server, each told to the client where it applies: there is no text (no transcripts,
no instructions, no tools); a response needs new user audio (or a voice prompt, before the first), else it fails
with `no_input`; audio appended while a response plays is heard after it (the engine holds it: the model's turn has a
silent user), and an end of turn meanwhile is answered when that response is over; items cannot be deleted or
truncated while a response plays; the voice changes at most once a second (each change is a new conversation in the
engine); `conversation.item.create` and `.retrieve` are not supported."""

from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import TYPE_CHECKING

import numpy as np
from websockets.exceptions import ConnectionClosed

from codec.pcm import SAMPLE_RATE
from s2s import AudioEvent, MetaEvent, Refused
from server.connection import Connection
from server.engine_session import events
from server.moshi.protocol import ProtocolError
from server.protocols import Request
from server.realtime.config import SessionConfig
from server.realtime.items import Item, Response, check_response, ms, new_id, truncation_end
from server.realtime.wire import GA_ONLY, RealtimeWire
from server.turn_metrics import TurnMetrics
from server.vad.config import Gate, VadConfig

if TYPE_CHECKING:
    from s2s import Engine

MIN_COMMIT_MS = 100  # OpenAI's: a commit of less is an error
VOICE_INTERVAL_S = 1.0  # a new voice opens a new conversation in the engine: at most one a second
BUSY = "a response is in progress: wait for response.done or send response.cancel"


class RealtimeSession:
    MODE = "turn"  # the engine's conversation behind it

    def __init__(
        self,
        engine: Engine,
        conn: Connection,
        cid: str,
        config: SessionConfig,
        base_vad: VadConfig,
        gate: Gate,
        model: str,
        metrics: TurnMetrics,
    ):
        self.engine, self.conn, self.cid, self.model, self.metrics = engine, conn, cid, model, metrics
        self.frame_size = engine.cfg.frame_size  # samples a frame of the engine's codec: what its edits count
        self.wire: RealtimeWire = conn.wire
        self.base_vad, self.gate, self.id = base_vad, gate, new_id("sess")
        self.items: dict[str, Item] = {}  # the conversation, in order
        self.awaiting: collections.deque[Item] = collections.deque()  # committed user items whose turn is unknown
        self.buffer_id, self.buffer_samples, self.received = new_id("item"), 0, 0
        self.response: Response | None = None
        self.unanswered = config.voice is not None  # what a response would answer: committed audio, or a prompt
        self.respond_after = False  # a VAD end of turn came while a response played: answer it once that is over
        self.finished_turn = -1  # the last engine turn a finished response had: audio of it or before is stale
        self.reopened = -math.inf  # when the last new voice opened a new conversation (time.monotonic())
        self.config: SessionConfig | None = None
        self.vad: VadConfig | None = None
        self._apply(config)
        self._events = asyncio.Lock()  # a response's events go out as one group: never interleaved with another's
        self._sender = asyncio.create_task(self._send())

    @classmethod
    async def open(
        cls,
        engine: Engine,
        conn: Connection,
        base_vad: VadConfig,
        gate: Gate,
        model: str,
        metrics: TurnMetrics,
        voice: str | None = None,
    ) -> RealtimeSession:
        """Raises `Refused` when the engine cannot admit it. `voice`: a voice prompt's name, from the URL."""
        config = cls.initial_config(voice)
        cid = engine.open(cls.MODE, prompt=voice, sampling=config.sampling)
        return cls(engine, conn, cid, config, base_vad, gate, model, metrics)

    @staticmethod
    def initial_config(voice: str | None) -> SessionConfig:
        return SessionConfig(voice=voice)

    def _apply(self, config: SessionConfig) -> None:
        td = config.turn_detection
        vad = td.vad(self.base_vad) if td else None
        if vad != self.vad:  # new endpointing settings: the core's endpointer takes them (`Endpointer.configure`)
            self.vad = vad
        self.config = config
        self.info = config.view(self.wire.beta, self.id, self.model)

    # ---- the core's calls --------------------------------------------------------------------------------------

    def audio(self, pcm: np.ndarray) -> None:
        self.engine.push_audio(self.cid, pcm)
        self.buffer_samples += len(pcm)
        self.received += len(pcm)

    async def barge_in(self, played_samples: int) -> None:
        td = self.config.turn_detection
        start = max(0, ms(self.received) - td.prefix_padding_ms)
        await self._event("input_audio_buffer.speech_started", audio_start_ms=start, item_id=self.buffer_id)
        if td.interrupt_response:
            await self._interrupt(played_samples // self.frame_size, "turn_detected")

    async def end_turn(self) -> None:
        await self.speech_ended()
        if not await self._commit() or not self.config.turn_detection.create_response:
            return
        if self.response is None:
            await self._respond({})
        else:
            self.respond_after = True

    async def speech_ended(self) -> None:
        end = max(0, ms(self.received) - self.config.turn_detection.silence_duration_ms)
        await self._event("input_audio_buffer.speech_stopped", audio_end_ms=end, item_id=self.buffer_id)

    async def stream(self, action: str) -> None:
        raise ProtocolError(f"the Realtime API has no {action} control", "unsupported_event")

    async def request(self, request: Request) -> None:
        handler = {
            "session.update": self._session_update,
            "input_audio_buffer.commit": lambda e: self._commit(explicit=True),
            "input_audio_buffer.clear": self._clear,
            "conversation.item.truncate": self._truncate,
            "conversation.item.delete": self._delete,
            "response.create": lambda e: self._respond(e.get("response") or {}),
            "response.cancel": self._cancel,
            "output_audio_buffer.clear": self._clear_output,
        }.get(kind := request.event["type"])
        if handler is None:
            raise ProtocolError(f"{kind} is not supported: this model hears and speaks audio only", "unsupported_event")
        await handler(request.event)

    async def close(self) -> None:
        self.engine.close(self.cid)
        await asyncio.wait_for(self._sender, 5)

    # ---- client events -------------------------------------------------------------------------------------------

    async def _session_update(self, event: dict) -> None:
        vocab = self.engine.model.config.codebook_size
        config = self.config.update(event.get("session"), self.wire.beta, list(self.engine.voices), vocab)
        if config.voice != self.config.voice:
            await self._reopen(config)
        elif config.sampling != self.config.sampling:
            self.engine.set_sampling(self.cid, config.sampling)
        self._apply(config)
        await self._event("session.updated", session=self.info)

    async def _reopen(self, config: SessionConfig) -> None:
        """A new voice: a new conversation in the engine, while there is nothing in the old one to lose."""
        if self.received or self.items or self.response:
            raise ProtocolError("the voice cannot change once the conversation has audio", "invalid_session")
        if (wait := self.reopened + VOICE_INTERVAL_S - time.monotonic()) > 0:
            raise ProtocolError(f"the voice changes at most once a second: try again in {wait:.1f} s", "rate_limited")
        try:
            cid = self.engine.open(self.MODE, prompt=config.voice, sampling=config.sampling)
        except Refused as e:
            raise ProtocolError(f"refused: {e}", "refused") from e
        self.engine.close(self.cid)
        await asyncio.wait_for(self._sender, 5)
        self.cid, self.unanswered, self.reopened = cid, config.voice is not None, time.monotonic()
        self._sender = asyncio.create_task(self._send())

    async def _commit(self, explicit: bool = False) -> bool:
        """The input buffer becomes a user item; False when it is empty."""
        if explicit and ms(self.buffer_samples) < MIN_COMMIT_MS:
            raise ProtocolError(
                f"buffer too small: {ms(self.buffer_samples)} ms of audio, at least {MIN_COMMIT_MS} ms is needed",
                "input_audio_buffer_commit_empty",
            )
        if not self.buffer_samples:
            return False
        previous = next(reversed(self.items), None)
        item = Item(self.buffer_id, "user", self.buffer_samples)
        self.items[item.id] = item
        self.awaiting.append(item)
        self.buffer_id, self.buffer_samples, self.unanswered = new_id("item"), 0, True
        self.engine.commit(self.cid)  # (while a reply plays, the engine closes the turn once the reply is over)
        await self._event("input_audio_buffer.committed", previous_item_id=previous, item_id=item.id)
        await self._event("conversation.item.added", previous_item_id=previous, item=item.view())
        await self._event("conversation.item.done", previous_item_id=previous, item=item.view())
        return True

    async def _clear(self, event: dict) -> None:
        self.engine.clear_input(self.cid)
        self.buffer_id, self.buffer_samples = new_id("item"), 0
        await self._event("input_audio_buffer.cleared")

    async def _respond(self, params: object) -> None:
        check_response(params)
        if self.response is not None:
            raise ProtocolError(BUSY, "conversation_already_has_active_response")
        await self._commit()
        if not self.unanswered:
            raise ProtocolError("nothing new to respond to: append audio first", "no_input")
        async with self._events:
            answers = next((i for i in reversed(self.items.values()) if i.role == "user"), None)
            previous = next(reversed(self.items), None)
            item = Item(new_id("item"), "assistant", status="in_progress")
            self.items[item.id] = item
            self.response = resp = Response(new_id("resp"), item, answers, params.get("metadata"))
            self.unanswered = False
            beta = self.wire.beta
            await self._event("response.created", response=resp.view("in_progress", beta))
            await self._event("response.output_item.added", response_id=resp.id, output_index=0, item=item.view())
            await self._event("conversation.item.added", previous_item_id=previous, item=item.view())
            await self._event("response.content_part.added", **resp.ids(), part={"type": "audio", "transcript": ""})
            self.wire.reply = resp.ids()
        self.engine.end_turn(self.cid)  # after the events that announce it: its audio comes after them

    async def _cancel(self, event: dict) -> None:
        resp = self.response
        if resp is None or event.get("response_id") not in (None, resp.id):
            raise ProtocolError("there is no response in progress to cancel", "response_cancel_not_active")
        await self._finish_cut(resp.item.samples // self.frame_size, "client_cancelled")  # what was sent stays

    async def _clear_output(self, event: dict) -> None:
        """A barge-in the client tells: what it has played of the last reply stays, the rest goes."""
        response_id = self.response.id if self.response else None
        await self._interrupt(self.conn.playback.played_samples() // self.frame_size, "client_cancelled")
        await self._event("output_audio_buffer.cleared", response_id=response_id)

    async def _truncate(self, event: dict) -> None:
        item = self._item(event)
        end = truncation_end(item, event)
        frames = end * SAMPLE_RATE // 1000 // self.frame_size
        if self.response is not None and self.response.item is item:
            await self._finish_cut(frames, "client_cancelled")
        elif self.response is not None:
            raise ProtocolError(BUSY, "conversation_already_has_active_response")
        elif item.turn is not None:
            self.engine.remove(self.cid, item.turn, "reply", frames)
        item.samples = end * SAMPLE_RATE // 1000
        await self._event("conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=end)

    async def _delete(self, event: dict) -> None:
        item = self._item(event)
        if self.response is not None:
            raise ProtocolError(BUSY, "conversation_already_has_active_response")
        if item in self.awaiting:
            raise ProtocolError("that item is still being committed: try again", "item_busy")
        if item.turn is not None:
            self.engine.remove(self.cid, item.turn, "user" if item.role == "user" else "reply")
        del self.items[item.id]
        await self._event("conversation.item.deleted", item_id=item.id)

    def _item(self, event: dict) -> Item:
        item_id = event.get("item_id")
        if not isinstance(item_id, str) or item_id not in self.items:
            raise ProtocolError(f"no item {item_id!r} in the conversation", "item_not_found")
        return self.items[item_id]

    # ---- responses -------------------------------------------------------------------------------------------

    async def _interrupt(self, played_frames: int, reason: str) -> None:
        """The response in progress is cut after what was played of it; with none, the last reply, while it may still
        be playing."""
        if self.response is not None:
            return await self._finish_cut(min(played_frames, self.response.item.samples // self.frame_size), reason)
        last = next((i for i in reversed(self.items.values()) if i.role == "assistant"), None)
        playing = self.conn.playback.until > time.monotonic() and self.conn.playback.turn == getattr(last, "turn", None)
        if last is not None and last.turn is not None and playing and played_frames * self.frame_size < last.samples:
            self.engine.remove(self.cid, last.turn, "reply", played_frames)
            last.samples = played_frames * self.frame_size
            await self._event(
                "conversation.item.truncated", item_id=last.id, content_index=0, audio_end_ms=ms(last.samples)
            )

    async def _finish_cut(self, frames: int, reason: str) -> None:
        """The response ends after `frames` frames: cut while it plays, or edited out if it is already made."""
        turn = self.response.turn
        if turn is None:  # its turn is not known yet, so neither is its reply: `interrupt` also stops it starting
            self.engine.interrupt(self.cid, frames)
        else:
            self.engine.remove(self.cid, turn, "reply", frames)
        self.response.item.samples = min(self.response.item.samples, frames * self.frame_size)
        await self._finish("cancelled", reason)

    async def _finish(self, status: str, reason: str | None = None, error: dict | None = None) -> None:
        async with self._events:
            resp, self.response, self.wire.reply = self.response, None, None
            resp.item.status = "completed" if status == "completed" else "incomplete"
            if resp.turn is not None:
                self.finished_turn = max(self.finished_turn, resp.turn)
            ids = resp.ids()
            await self._event("response.output_audio.done", **ids)
            await self._event("response.content_part.done", **ids, part={"type": "audio", "transcript": ""})
            await self._event("response.output_item.done", response_id=resp.id, output_index=0, item=resp.item.view())
            await self._event("conversation.item.done", item=resp.item.view())
            await self._event("response.done", response=resp.view(status, self.wire.beta, reason, error))
        if resp.times:
            self.metrics.observe("realtime", resp.times)
        if self.respond_after:
            self.respond_after = False
            try:
                await self._respond({})
            except ProtocolError as e:  # (nothing new after all: its audio made no frame)
                await self.conn.send_error(str(e), e.code)

    # ---- engine events -----------------------------------------------------------------------------------------

    async def _send(self) -> None:
        async for event in events(self.engine.event_queue(self.cid), self.conn):
            try:
                if isinstance(event, AudioEvent):
                    await self._reply_audio(event)
                elif isinstance(event, MetaEvent):
                    await self._engine_event(event.data)
            except ConnectionClosed:
                continue  # keep draining until the conversation is closed

    async def _reply_audio(self, event: AudioEvent) -> None:
        resp = self.response
        if resp is None or event.turn <= self.finished_turn or resp.turn not in (None, event.turn):
            return  # a cancelled reply's, still on its way
        resp.item.turn = event.turn
        resp.item.samples += len(event.pcm)
        await self.conn.send_audio(event.pcm, event.turn)

    async def _engine_event(self, data: dict) -> None:
        kind, resp = data.get("event"), self.response
        if kind == "committed" and self.awaiting:  # one for each commit, in order (its turn None: nothing closed)
            self.awaiting.popleft().turn = data["turn"]
        elif kind == "reply_done" and resp is not None and resp.turn in (None, data["turn"]):
            resp.item.turn, resp.times = data["turn"], data["times"]
            full = data["frames"] >= self.engine.cfg.max_reply_frames
            await self._finish("incomplete" if full else "completed", "max_output_tokens" if full else None)
        elif kind == "no_reply" and resp is not None and not resp.item.samples:
            error = {"type": "invalid_request_error", "code": "no_input", "message": "nothing new to respond to"}
            await self._finish("failed", error=error)
        elif kind == "error":
            await self.conn.send_error(data["message"], "engine_error")

    async def _event(self, kind: str, **fields) -> None:
        if not (self.wire.beta and kind in GA_ONLY):
            await self.conn.send_event({"type": kind, **fields})
