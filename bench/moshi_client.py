"""One duplex Moshi-protocol client, in a process of its own, for `s2s bench moshi`: it streams speech in real time
as Ogg/Opus, as Kyutai's `moshi.client` does, and records when everything came back.

    python -m bench.moshi_client URL SPEECH.npy START_AT OUT.json [--grace-s 1] [--idle-s 1] [--patience-s 600]

At `time.monotonic()` START_AT (the machine's clock, the same in every process) it opens `URL/api/chat` with no
query, as Kyutai's client does (duplex, Opus, for both servers), and from the upgrade on sends SPEECH (float32, 24
kHz) in 80 ms blocks, each once its last sample has been spoken (as a microphone does; the Opus pages are encoded
before the clock starts, so that the client's own encoding does not compete with the server it measures). It does
not wait for the handshake: Kyutai's client does not either, and Kyutai's server sends it only once its lock is
taken. After its speech it listens until the server has sent nothing for `--idle-s` (once some audio came and
`--grace-s` has passed), or `--patience-s` after its speech at most (a client queued behind Kyutai's lock waits
for its turn). OUT.json gets the times of everything received (relative to the first audio sent), and the verdict:
- `kept`: the conversation kept real time: by the end of its speech plus `--grace-s`, at least 95 % of its speech's
  length came back as audio, and no gap between audio messages (from the first audio sent to the end of speech)
  was over 1 s;
- `first_audio_s`, `first_text_s`: from the first audio sent to the first audio (decoded samples) and to the first
  text (`0x02`) received; `handshake_s`: from the upgrade to the handshake (`0x00`);
- `lag_ms_p50`/`p95`: when each reply sample arrived, minus when the user spoke the sample at the same position.
Imports neither torch nor the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np
import sphn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

SAMPLE_RATE = 24000
BLOCK = 1920  # 80 ms: Kyutai's client's blocks
KEPT_FRACTION = 0.95
MAX_GAP_S = 1.0


def encoded(pcm: np.ndarray) -> list[tuple[float, bytes]]:
    """(seconds spoken when the block goes, its Opus bytes) for each 80 ms block that yields any."""
    writer = sphn.OpusStreamWriter(SAMPLE_RATE)
    out = []
    for a in range(0, len(pcm) - BLOCK + 1, BLOCK):
        payload = bytes(writer.append_pcm(pcm[a : a + BLOCK]))
        out.append(((a + BLOCK) / SAMPLE_RATE, payload))
    return out


async def converse(url: str, pcm: np.ndarray, start_at: float, grace_s: float, idle_s: float, patience_s: float):
    blocks = encoded(pcm)
    speech_s = len(blocks) * BLOCK / SAMPLE_RATE
    rec: dict = {"speech_s": speech_s, "refusal": None, "errors": [], "handshake": None}
    audio: list[tuple[float, int]] = []  # (arrival, samples)
    texts: list[tuple[float, str]] = []
    reader = sphn.OpusStreamReader(SAMPLE_RATE)
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    t_connect = time.monotonic()
    try:  # no keepalive pings: Kyutai's client sends none, and a conversation queued on Kyutai's lock answers none
        ws = await connect(f"{url}/api/chat", max_size=None, open_timeout=60, ping_interval=None)
    except InvalidStatus as e:
        rec["refusal"] = f"HTTP {e.response.status_code}: {e.response.body.decode(errors='replace').strip()}"
        return rec
    except (OSError, TimeoutError) as e:
        rec["refusal"] = f"{type(e).__name__}: {e}"
        return rec
    t_open = time.monotonic()
    rec["connect_s"] = t_open - t_connect
    last_audio = [0.0]

    async def receive() -> None:
        try:
            async for message in ws:
                now = time.monotonic()
                kind = message[0]
                if kind == 0:
                    rec["handshake"] = now - t_open
                elif kind == 1:
                    n = len(reader.append_bytes(message[1:]))
                    if n:
                        audio.append((now, n))
                        last_audio[0] = now
                elif kind == 2:
                    texts.append((now, message[1:].decode(errors="replace")))
                elif kind == 5:
                    rec["errors"].append(message[1:].decode(errors="replace"))
        except ConnectionClosed as e:
            if e.rcvd is not None and e.rcvd.code not in (1000, 1001):
                rec["errors"].append(f"closed {e.rcvd.code} {e.rcvd.reason}")

    receiving = asyncio.create_task(receive())
    first_sent = None
    start = time.monotonic()
    try:
        for spoken, payload in blocks:
            await asyncio.sleep(max(0.0, start + spoken - time.monotonic()))
            if payload:
                await ws.send(b"\x01" + payload)
                if first_sent is None:
                    first_sent = time.monotonic()
        end = time.monotonic()
        while not receiving.done():
            now = time.monotonic()
            if now > end + patience_s:
                break
            if audio and now > end + grace_s and now - last_audio[0] > idle_s:
                break
            await asyncio.sleep(0.05)
    except ConnectionClosed:
        end = time.monotonic()
    await ws.close()
    try:
        await asyncio.wait_for(receiving, 5)
    except TimeoutError:
        receiving.cancel()
    first_sent = first_sent if first_sent is not None else start
    rec.update(verdict(audio, texts, first_sent, start, end, speech_s, grace_s))
    rec["closed_after_speech_s"] = time.monotonic() - end
    return rec


def verdict(audio, texts, first_sent, start, end, speech_s, grace_s) -> dict:
    """The client's measures (the module docstring), times relative to the first audio sent."""
    by = end + grace_s
    received_by = sum(n for t, n in audio if t <= by) / SAMPLE_RATE
    points = [first_sent] + [t for t, _ in audio if t <= by]
    if points[-1] < end:
        points.append(end)
    max_gap = float(np.max(np.diff(points))) if len(points) > 1 else float("inf")
    lags, got = [], 0
    for t, n in audio:
        got += n
        lags.append(t - start - got / SAMPLE_RATE)  # output sample k answers the user's sample k
    kept = received_by >= KEPT_FRACTION * speech_s and max_gap <= MAX_GAP_S
    return {
        "kept": bool(kept),
        "first_audio_s": audio[0][0] - first_sent if audio else None,
        "first_text_s": texts[0][0] - first_sent if texts else None,
        "received_s": sum(n for _, n in audio) / SAMPLE_RATE,
        "received_by_end_s": received_by,
        "max_gap_s": max_gap,
        "last_audio_after_speech_s": audio[-1][0] - end if audio else None,
        "lag_ms_p50": float(np.percentile(lags, 50) * 1000) if lags else None,
        "lag_ms_p95": float(np.percentile(lags, 95) * 1000) if lags else None,
        "texts": len(texts),
        "text": "".join(p for _, p in texts)[:200],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("speech", type=Path)
    p.add_argument("start_at", type=float)
    p.add_argument("out", type=Path)
    p.add_argument("--grace-s", type=float, default=1.0)
    p.add_argument("--idle-s", type=float, default=1.0)
    p.add_argument("--patience-s", type=float, default=600.0)
    args = p.parse_args()
    pcm = np.load(args.speech).astype(np.float32)
    rec = asyncio.run(converse(args.url, pcm, args.start_at, args.grace_s, args.idle_s, args.patience_s))
    args.out.write_text(json.dumps(rec))


if __name__ == "__main__":
    main()
