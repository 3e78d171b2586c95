"""DuplexSession: the Realtime API over a full-duplex conversation in the engine, for a model with a text stream
(Moshi's family: `engine.model.config.text_stream`), which serves duplex conversations only.

Such a model listens and speaks at once, every 80 ms frame, and decides itself when to speak; its text stream (its
inner monologue: a text id a frame, padding between words) says what it says. So:

- The user's audio streams into the conversation as it is appended (`input_audio_buffer.append`), in real time;
  nothing is committed and no user items are made: the model hears it as it comes. The model makes a frame for each
  frame it hears, so a client streams all the time, its silence too, as a full-duplex client does: a response ends
  only as the stream goes on.
- The model's speech comes out as responses, one per utterance, delimited by its text: a response (with its one
  assistant item) starts at the first frame whose text is not padding, and ends once the text has been padding for
  `UTTERANCE_END_S` (its last frames, that padding, are in it). Frames outside a response (the model's silence) are
  not sent.

A response's events, in order:

    response.created, response.output_item.added, conversation.item.added, response.content_part.added
    then, as its frames are made: response.output_audio.delta (its frames' audio) and, where those frames have
        text, response.output_audio_transcript.delta (their text)
    then: response.output_audio.done, response.output_audio_transcript.done (the whole text),
        response.content_part.done and response.output_item.done and conversation.item.done (the item, its
        `content[0].transcript` the whole text), response.done (status completed, its output that item)

with the beta's names for a beta client (`wire.py`). The text of a frame is `TextPieces.text` of its id (padding
gives none): the deltas join into the `.done` transcript.

Client events that cannot apply to a duplex stream are answered with an `error` event (code `unsupported_event`,
its message saying why) and change nothing; the session goes on:
- `input_audio_buffer.commit` and `.clear`: there is no input buffer, the audio is already heard;
- `response.create`: the model speaks when it chooses; `response.cancel` and `output_audio_buffer.clear`: its
  speech cannot be stopped (it hears the user as it speaks: speaking over it is the way to interrupt it);
- `conversation.item.truncate` and `.delete`: the conversation is one stream in the model's context;
- `conversation.item.create` and `.retrieve`, as in turn mode;
- `session.update` with a `turn_detection` other than null (the session shows null: there is none), with code
  `invalid_session`, as any update it cannot apply whole. The rest of `session.update` is as in turn mode
  (`config.py`): sampling, and the voice while no audio was appended."""

from __future__ import annotations

import math

import numpy as np
from websockets.exceptions import ConnectionClosed

from codec.pcm import SAMPLE_RATE
from s2s import AudioEvent, MetaEvent
from server.engine_session import events, frame_texts
from server.moshi.protocol import ProtocolError
from server.protocols import Request
from server.realtime.config import SessionConfig
from server.realtime.items import Item, Response, new_id
from server.realtime.session import RealtimeSession

UTTERANCE_END_S = 1.0  # a response ends once the model's text has been padding this long
WHY = "this model is full duplex"
UNSUPPORTED = {
    "input_audio_buffer.commit": f"{WHY}: appended audio streams into the conversation as it comes, "
    "with no buffer to commit",
    "input_audio_buffer.clear": f"{WHY}: appended audio is heard as it comes, with no buffer to clear",
    "response.create": f"{WHY}: it speaks when it chooses, each utterance a response of its own; "
    "a response cannot be asked for",
    "response.cancel": f"{WHY}: its speech cannot be cancelled; it hears you as it speaks (speak over it)",
    "output_audio_buffer.clear": f"{WHY}: its speech cannot be cut; it hears you as it speaks (speak over it)",
    "conversation.item.truncate": f"{WHY}: the conversation is one stream in its context, "
    "whose items cannot be truncated",
    "conversation.item.delete": f"{WHY}: the conversation is one stream in its context, whose items cannot be deleted",
}


class DuplexSession(RealtimeSession):
    """A duplex conversation's responses, cut from its frames by their text. Session settings and voice changes are
    `RealtimeSession`'s (a voice changes only before any audio)."""

    MODE = "duplex"

    def __init__(self, engine, conn, cid, config, base_vad, gate, model, metrics):
        self.text_pieces = engine.model.text_pieces  # (the endpoint checked the model has them)
        frame_size = engine.cfg.frame_size
        self.end_frames = math.ceil(UTTERANCE_END_S * SAMPLE_RATE / frame_size)  # padding frames that end one
        self.quiet = 0  # padding frames since the response's last text
        super().__init__(engine, conn, cid, config, base_vad, gate, model, metrics)
        self.gate = None  # (no endpointing: `vad` is None)

    @staticmethod
    def initial_config(voice: str | None) -> SessionConfig:
        return SessionConfig(voice=voice, turn_detection=None, duplex=True)

    # ---- the core's calls --------------------------------------------------------------------------------------

    def audio(self, pcm: np.ndarray) -> None:
        self.engine.push_audio(self.cid, pcm)
        self.received += len(pcm)

    async def barge_in(self, played_samples: int) -> None:
        pass  # (no VAD runs on a duplex session's audio)

    async def end_turn(self) -> None:
        pass  # a duplex stream has no turns to end

    async def speech_ended(self) -> None:
        pass

    async def request(self, request: Request) -> None:
        kind = request.event["type"]
        if kind == "session.update":
            return await self._session_update(request.event)
        if kind in UNSUPPORTED:
            raise ProtocolError(f"{kind}: {UNSUPPORTED[kind]}", "unsupported_event")
        raise ProtocolError(f"{kind} is not supported: this model hears and speaks audio only", "unsupported_event")

    # ---- engine events -----------------------------------------------------------------------------------------

    async def _send(self) -> None:
        async for event in events(self.engine.event_queue(self.cid), self.conn):
            try:
                if isinstance(event, AudioEvent):
                    await self._frames(event)
                elif isinstance(event, MetaEvent) and event.data.get("event") == "error":
                    await self.conn.send_error(event.data["message"], "engine_error")
            except ConnectionClosed:
                continue  # keep draining until the conversation is closed

    async def _frames(self, event: AudioEvent) -> None:
        """The event's frames, in order: each starts, continues or ends a response, or is left out (silence)."""
        n = len(event.pcm) // self.frame_size
        texts = frame_texts(self.text_pieces, event.text) if event.text is not None else [""] * n
        f = 0
        while f < n:
            if self.response is None:
                f = next((i for i in range(f, n) if texts[i]), n)  # the model's silence: not sent
                if f == n:
                    return
                await self._start()
            end = n
            for i in range(f, n):
                self.quiet = 0 if texts[i] else self.quiet + 1
                if self.quiet >= self.end_frames:
                    end = i + 1
                    break
            await self._deliver(event.pcm[f * self.frame_size : end * self.frame_size], "".join(texts[f:end]), event)
            if self.quiet >= self.end_frames:
                await self._end()
            f = end

    async def _start(self) -> None:
        previous = next(reversed(self.items), None)
        item = Item(new_id("item"), "assistant", status="in_progress", transcript="")
        self.items = {item.id: item}  # (only the last is ever named again: a long stream's memory stays fixed)
        self.response = resp = Response(new_id("resp"), item, None, None)
        self.quiet = 0
        await self._event("response.created", response=resp.view("in_progress", self.wire.beta))
        await self._event("response.output_item.added", response_id=resp.id, output_index=0, item=item.view())
        await self._event("conversation.item.added", previous_item_id=previous, item=item.view())
        await self._event("response.content_part.added", **resp.ids(), part={"type": "audio", "transcript": ""})
        self.wire.reply = resp.ids()

    async def _deliver(self, pcm: np.ndarray, text: str, event: AudioEvent) -> None:
        """Frames of the response in progress: their audio, then their text."""
        resp = self.response
        resp.item.samples += len(pcm)
        await self.conn.send_audio(pcm, event.turn)
        if text:
            resp.item.transcript += text
            await self._event("response.output_audio_transcript.delta", **resp.ids(), delta=text)

    async def _end(self) -> None:
        resp, self.response, self.wire.reply = self.response, None, None
        item, ids = resp.item, resp.ids()
        item.status = "completed"
        await self._event("response.output_audio.done", **ids)
        await self._event("response.output_audio_transcript.done", **ids, transcript=item.transcript)
        await self._event("response.content_part.done", **ids, part={"type": "audio", "transcript": item.transcript})
        await self._event("response.output_item.done", response_id=resp.id, output_index=0, item=item.view())
        await self._event("conversation.item.done", item=item.view())
        await self._event("response.done", response=resp.view("completed", self.wire.beta))
