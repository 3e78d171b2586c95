"""`s2s client`: stream a WAV file to a server in real time (or faster), save the reply, print per-turn latency."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import sphn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from codec.pcm import SAMPLE_RATE, from_pcm16, to_pcm16
from server.moshi import protocol
from server.moshi.protocol import BLOCK, Control, Kind, metadata_of


def refusal_of(e: InvalidStatus) -> str:
    """What a server that answered the upgrade with an HTTP error says: "refused: REASON" for a full or draining
    one (503, or 429 for a client at its limit), or the status."""
    body = e.response.body.decode(errors="replace").strip()
    return body or f"HTTP {e.response.status_code}"


@dataclass
class ClientResult:
    reply: np.ndarray  # everything the server sent back, float32 24 kHz
    handshake: bool = False
    errors: list[str] = field(default_factory=list)
    metadata: list[dict] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # the model's text stream, as its `0x02` messages came
    turn_latency_s: float | None = None  # true end of speech to the first reply audio after it
    done_samples: int | None = None  # turn mode: reply samples received when the `reply_done` after the speech came
    speech_started: float | None = None  # time.monotonic() when the first speech sample was "spoken"


async def talk(
    url: str,
    speech: np.ndarray,
    mode: str = "turn",
    codec: str = "pcm16",
    speed: float = 1.0,
    listen_s: float = 3.0,
    end_turn: bool = True,
    on_audio: Callable[[tuple[float, int]], None] | None = None,
    on_text: Callable[[str], None] | None = None,
    linger_s: float = 0.0,
    **params: str,
) -> ClientResult:
    """Send `speech` in 80 ms blocks at `speed` x real time, then (turn mode, unless `end_turn=False`, which leaves
    it to the server's VAD) an end of turn; collect the reply for `listen_s` seconds after the end of speech, or in
    turn mode until the first `reply_done` after it, whichever comes first: on a slow machine a generous `listen_s`
    costs nothing. In duplex, where the server answers each frame it hears with one, the listening goes on while the
    reply still comes (a slow server catching up): until `listen_s` has passed with no audio, for three times the
    speech's length more at most.
    In turn mode the client stays `linger_s` seconds after that `reply_done`: what comes then is in `reply` too.
    `on_audio((arrival time, samples))` is called for each audio message received, `on_text(piece)` for each text
    message (a model with a text stream: Moshi's inner monologue)."""
    query = "&".join(f"{k}={v}" for k, v in {"mode": mode, "codec": codec, **params}.items())
    result = ClientResult(np.zeros(0, dtype=np.float32))
    chunks: list[np.ndarray] = []
    opus_in = sphn.OpusStreamReader(SAMPLE_RATE) if codec == "opus" else None
    payloads = _encoded(speech, codec)
    end_of_speech: float | None = None
    last_audio = 0.0  # time.monotonic() of the latest reply audio
    reply_done = asyncio.Event()

    try:
        ws = await connect(f"{url}/api/chat?{query}", max_size=None)
    except InvalidStatus as e:  # refused before the upgrade
        result.errors.append(refusal_of(e))
        return result
    async with ws:

        async def receive() -> None:
            try:
                await _read(ws)
            except ConnectionClosed:
                pass  # the server closed (a refusal or an error says why in result.errors)

        async def _read(ws) -> None:
            nonlocal last_audio
            async for message in ws:
                kind = message[0]
                if kind == Kind.HANDSHAKE:
                    result.handshake = True
                elif kind == Kind.AUDIO:
                    pcm = opus_in.append_bytes(message[1:]) if opus_in else from_pcm16(message[1:])
                    if len(pcm):
                        last_audio = time.monotonic()
                        if end_of_speech is not None and result.turn_latency_s is None and mode == "turn":
                            result.turn_latency_s = time.monotonic() - end_of_speech
                        chunks.append(np.asarray(pcm, dtype=np.float32))
                        if on_audio is not None:
                            on_audio((time.monotonic(), len(pcm)))
                elif kind == Kind.TEXT:
                    piece = message[1:].decode(errors="replace")
                    result.text.append(piece)
                    if on_text is not None:
                        on_text(piece)
                elif kind == Kind.ERROR:
                    result.errors.append(message[1:].decode(errors="replace"))
                elif kind == Kind.METADATA:
                    result.metadata.append(metadata_of(message))
                    done = end_of_speech is not None and result.metadata[-1].get("event") == "reply_done"
                    if done and not reply_done.is_set():
                        result.done_samples = sum(len(c) for c in chunks)
                        reply_done.set()

        reader = asyncio.create_task(receive())
        start = result.speech_started = time.monotonic()
        try:
            for spoken, payload in payloads:
                # as a microphone does: a block goes once its last sample has been spoken
                await asyncio.sleep(max(0.0, start + spoken / SAMPLE_RATE / speed - time.monotonic()))
                if len(payload):
                    await ws.send(protocol.audio(payload))
            end_of_speech = time.monotonic()
            if mode == "turn" and end_turn:
                await ws.send(protocol.control(Control.END_TURN))
            if mode == "turn":
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reply_done.wait(), listen_s)
                    await asyncio.sleep(linger_s)
            else:
                cap = end_of_speech + listen_s + 3 * len(speech) / SAMPLE_RATE / speed
                while (wait := min(max(end_of_speech, last_audio) + listen_s, cap) - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
        except ConnectionClosed:
            pass
        await ws.close()
        await asyncio.wait_for(reader, 5)
    result.reply = np.concatenate(chunks) if chunks else result.reply
    return result


def _encoded(speech: np.ndarray, codec: str) -> list[tuple[int, bytes]]:
    """Each 80 ms block's payload, with the samples spoken once it has been: encoded before the conversation starts,
    so that a load generator's Opus encoding (sphn's VoIP mode, about 12 ms of CPU per stream-second) does not
    compete on the clock with the server it measures."""
    opus_out = sphn.OpusStreamWriter(SAMPLE_RATE) if codec == "opus" else None
    out = []
    for a in range(0, len(speech), BLOCK):
        block = speech[a : a + BLOCK]
        payload = opus_out.append_pcm(block) if opus_out else to_pcm16(block)
        out.append((a + len(block), bytes(payload)))
    return out
