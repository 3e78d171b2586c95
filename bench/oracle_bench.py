"""The shipped weights, heard by the oracle: pocketsphinx over a JSGF grammar of the 40 held-out sentences, spoken
by the 2 held-out voices (`speech/`), none of them seen in training.

    s2s bench oracle [--quick] [--json PATH] [--plot PATH]

Rows, each a recognition rate (the share of takes heard as their own sentence) and that rate over the originals'
rate on the same takes:
- the originals, clean;
- the codec's round trip, offline at each bandwidth, and streaming (80 ms blocks in, frame by frame out) at 1.5;
- turn mode through the server (4 conversations at a time, sent at 2x real time, seeded), pcm16 and Ogg/Opus, in
  each cache mode, and the share of replies that ended (`reply_done` within the question's length and a second,
  nothing after it);
- duplex through the server in real time: the whole echo, its half second of delay included;
- cross-talk: rounds of 4 conversations at once, each a different sentence, sharing a voice prompt, radix cache with
  48 pages of 16 steps (preemption forced): how many replies are heard as another conversation's sentence.
"""

from __future__ import annotations

import asyncio

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from bench.common import environment, parser, print_table, save_outputs
from codec import BANDWIDTHS, EncodecTokenizer
from codec.pcm import SAMPLE_RATE
from s2s import Engine, EngineConfig, S2SModel
from s2s.models.shipped import shipped
from server.app import ChatServer, ServerOptions
from server.moshi.client import ClientResult, talk
from speech import oracle
from speech.sentences import training_sentences
from speech.voices import TRAIN_VOICES, say

LINGER_S = 0.5  # seconds a turn's client listens on after its reply_done
CACHE_MODES = ("naive", "paged", "exact", "radix")


async def replies(
    url: str, takes: list[oracle.Take], mode: str, codec: str, at_once: int = 4, **params: str
) -> list[ClientResult]:
    """Each take spoken to the server at `url`, `at_once` conversations at a time, seeded by its place. Turn mode
    sends at 2x real time (within the server's burst; the reply waits for the end of the turn); duplex in real time,
    followed by a second of silence, as a microphone goes on, for the echo's delay to pass. A turn's client stays
    half a second after its `reply_done`, to hear anything that follows it. Returns the clients' results (`.reply`:
    the audio); a refused or failed conversation raises."""
    speed, listen, tail = (2.0, 60.0, 0) if mode == "turn" else (1.0, 1.5, SAMPLE_RATE)
    out = []
    for i in range(0, len(takes), at_once):
        batch = takes[i : i + at_once]
        out += await asyncio.gather(
            *(
                talk(
                    url,
                    np.concatenate([t.pcm, np.zeros(tail, np.float32)]),
                    mode=mode,
                    codec=codec,
                    speed=speed,
                    listen_s=listen,
                    linger_s=LINGER_S if mode == "turn" else 0.0,
                    seed=str(i + j),
                    **params,
                )
                for j, t in enumerate(batch)
            )
        )
    failed = [r.errors or ["refused"] for r in out if not r.handshake or r.errors]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(out)} conversations failed: {failed[:3]}")
    return out


def ended(take: oracle.Take, result: ClientResult) -> bool:
    """The reply ended as a turn's must: its `reply_done` came within the question's length and a second, and no
    audio followed it."""
    done = result.done_samples
    return done is not None and done <= len(take.pcm) + SAMPLE_RATE and len(result.reply) == done


def serve(model, tok, body, voices: dict | None = None, **engine_kw):
    """An engine (`EngineConfig` from `engine_kw`, with `voices`: name -> prompt codes) behind a server on a free
    port, ticking as `s2s serve` does; returns `await body(url, engine)`."""
    engine_kw.setdefault("num_pages", 3072)  # naive mode reserves a whole context per conversation
    engine_kw.setdefault("frames_per_tick", 4)  # as `s2s serve`
    # what is measured is what the replies say, not admission (the cost model, learning on a busy machine, could
    # refuse a conversation); the calibration ticks also warm the engine up before the first duplex stream
    cfg = EngineConfig(max_context=4096, max_reply_frames=600, admission_headroom=100.0, **engine_kw)

    async def main():
        engine = Engine(model, tok, cfg)
        for name, codes in (voices or {}).items():
            engine.add_voice(name, codes)
        server = ChatServer(engine, ServerOptions(port=0))
        port = await server.start()
        try:
            return await body(f"ws://127.0.0.1:{port}", engine)
        finally:
            await server.stop()

    return asyncio.run(main())


def row(what: str, takes: list[oracle.Take], got: list, originals: dict[int, bool]) -> dict:
    """`got`: each take's audio, or the server's `ClientResult` (a turn's: whether the reply `ended` too)."""
    audios = [g.reply if isinstance(g, ClientResult) else g for g in got]
    rate = oracle.rate(takes, audios)
    base = float(np.mean([originals[id(t)] for t in takes]))
    out = {"what": what, "takes": len(takes), "rate": rate, "originals": base, "relative": rate / base}
    if "turn" in what:
        out["ended"] = float(np.mean([ended(t, g) for t, g in zip(takes, got, strict=True)]))
    return out


def cross_talk(model, tok, takes: list[oracle.Take], rounds: int) -> dict:
    prompt = tok.encode(say(training_sentences(1, seed=5)[0], TRAIN_VOICES[0]))[0]
    crossed, own, preempted = [], 0, 0
    for r in range(rounds):
        four = takes[r * 4 : r * 4 + 4]

        async def body(url, engine, four=four):
            got = await replies(url, four, "turn", "pcm16", voice="shared")
            return got, engine.snapshot().stats.preempted

        got, p = serve(model, tok, body, voices={"shared": prompt}, cache_mode="radix", num_pages=48)
        preempted += p
        for t, result in zip(four, got, strict=True):
            h = oracle.heard(result.reply)
            crossed.append(h in {s.index for s in four} - {t.index})
            own += h == t.index
    return {
        "what": "cross-talk, 4 at once, radix, 48 pages",
        "takes": 4 * rounds,
        "rate": own / (4 * rounds),
        "heard_as_another": int(sum(crossed)),
        "preempted": preempted,
    }


def main() -> None:
    p = parser("oracle", __doc__.splitlines()[0])
    args = p.parse_args()
    takes = oracle.takes()
    per_cell = 4 if args.quick else 10
    originals = {id(t): oracle.heard(t.pcm) == t.index for t in takes}
    rows = [row("originals", takes, [t.pcm for t in takes], originals)]
    codec_takes = takes[::4] if args.quick else takes
    for bandwidth in (1.5,) if args.quick else BANDWIDTHS:
        tok = EncodecTokenizer.from_pretrained(shipped("codec"), bandwidth=bandwidth)
        audios = [oracle.offline_round_trip(tok, t.pcm) for t in codec_takes]
        rows.append(row(f"codec {bandwidth:g} kbps, offline", codec_takes, audios, originals))
    tok = EncodecTokenizer.from_pretrained(shipped("codec"), bandwidth=1.5)
    stream_takes = codec_takes[::2]
    audios = [oracle.streaming_round_trip(tok, t.pcm) for t in stream_takes]
    rows.append(row("codec 1.5 kbps, streaming", stream_takes, audios, originals))
    model = S2SModel.from_pretrained(shipped("model"))
    offset = 0
    for cache in CACHE_MODES:
        for codec in ("pcm16", "opus"):
            cell = takes[offset : offset + per_cell]
            offset = (offset + per_cell) % len(takes)

            async def body(url, engine, cell=cell, codec=codec):
                return await replies(url, cell, "turn", codec)

            rows.append(row(f"turn, {codec}, {cache}", cell, serve(model, tok, body, cache_mode=cache), originals))
    for codec in ("opus", "pcm16"):
        cell = takes[offset : offset + 2 * per_cell]
        offset = (offset + 2 * per_cell) % len(takes)

        async def duplex(url, engine, cell=cell, codec=codec):
            return await replies(url, cell, "duplex", codec)

        rows.append(row(f"duplex, {codec}", cell, serve(model, tok, duplex, cache_mode="radix"), originals))
    rows.append(cross_talk(model, tok, takes[::2], 2 if args.quick else 5))
    env = environment()
    for r in rows:
        r.update(env)
    columns = [
        ("what", "measured"),
        ("takes", "takes"),
        ("rate", "heard"),
        ("originals", "originals heard"),
        ("relative", "heard / originals"),
        ("ended", "replies ended"),
        ("heard_as_another", "heard as another's"),
        ("preempted", "preempted"),
    ]
    tables = print_table("The oracle: held-out sentences and voices, heard by pocketsphinx (JSGF)", rows, columns)
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(rows) + 1))
    ax.barh([r["what"] for r in rows], [r["rate"] for r in rows])
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("share of takes heard as their own sentence")
    fig.tight_layout()
    fig.savefig(args.plot)
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
