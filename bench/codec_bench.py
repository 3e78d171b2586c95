"""Codec benchmark: first-chunk decode latency and batched streaming encode + decode throughput.

    s2s bench codec [--codec encodec|mimi] [--quick] [--json PATH] [--plot PATH]

(`--codec mimi`: Kyutai's streaming Mimi against this one, `bench/codec_mimi.py`; what follows is EnCodec's.)

Three measurements, side by side in one run on the same weights (seeded, weight norm folded):
1. TTFA of the codec for one conversation: a fresh streaming decoder, the first frame pushed, until its samples are out;
   next to transformers' `EncodecModel.decode` of that one frame (its fastest honest use: folded weights,
   inference mode).
2. Batched streaming: B conversations, each pushing `chunk` frames of PCM into one StreamingEncoder and `chunk` frames
   of codes into one StreamingDecoder per tick. A tick must finish within `chunk` x 13.33 ms for the B conversations
   to stay real time; `rtf` = tick time / audio time per tick (per conversation, < 1 is real time).
3. Baseline: transformers' EnCodec in a per-frame loop, one conversation at a time (encode 320 samples, decode one
   frame, both stateless), and transformers' offline batch over whole signals (the compute bound: no streaming at all).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

from bench import codec_mimi
from bench.common import environment, parser, peak_rss_bytes, percentiles, print_table, save_outputs, timed
from codec import EncodecTokenizer

FRAME_MS = 1000 / 75


def signal(rows: int, frames: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (0.3 * torch.randn(rows, frames * 320, generator=g)).clamp(-1, 1)


@torch.inference_mode()
def first_chunk(tok: EncodecTokenizer, repeats: int) -> list[dict]:
    codes = tok.encode(signal(1, 16))
    dec = tok.streaming_decoder(1)
    fresh, steady, ref = [], [], []
    for _ in range(repeats):
        dec.reset(0)
        t, _ = timed(dec.push, codes[..., :1])
        fresh.append(t)
        dec.push(codes[..., 1 : tok.decoder_warmup_frames])
        t, _ = timed(dec.push, codes[..., tok.decoder_warmup_frames : tok.decoder_warmup_frames + 1])
        steady.append(t)
        t, _ = timed(tok.model.decode, codes[None, ..., :1], [None])
        ref.append(t)
    rows = []
    for name, samples in (
        ("streaming decoder, first frame", fresh),
        ("streaming decoder, a later frame", steady),
        ("transformers decode, one frame", ref),
    ):
        p = percentiles(samples, 1000)
        rows.append({"bench": "first_chunk", "path": name, "repeats": repeats, **{f"ms_{k}": v for k, v in p.items()}})
    return rows


@torch.inference_mode()
def streaming(tok: EncodecTokenizer, batch: int, chunk: int, ticks: int, pool: ThreadPoolExecutor | None) -> dict:
    """One config; with `pool`, the encoder and decoder run at once on two threads with one intra-op thread each."""
    warm = tok.encoder_warmup_frames + 1
    pcm = signal(batch, warm + ticks * chunk, seed=batch * 100 + chunk)
    codes = tok.encode(pcm)
    enc, dec = tok.streaming_encoder(batch), tok.streaming_decoder(batch)
    enc.push(pcm[:, : warm * 320])
    dec.push(codes[..., :warm])

    def tick(a: int) -> None:
        if pool is None:
            enc.push(pcm[:, a * 320 : (a + chunk) * 320])
            dec.push(codes[..., a : a + chunk])
        else:
            jobs = [
                pool.submit(enc.push, pcm[:, a * 320 : (a + chunk) * 320]),
                pool.submit(dec.push, codes[..., a : a + chunk]),
            ]
            for job in jobs:
                job.result()

    threads = torch.get_num_threads()
    torch.set_num_threads(1 if pool else threads)
    times = [timed(tick, warm + i * chunk)[0] for i in range(ticks)]
    torch.set_num_threads(threads)
    audio_ms = chunk * FRAME_MS
    p = percentiles(times, 1000)
    return {
        "bench": "streaming",
        "threads": "enc and dec in parallel, 1 thread each" if pool else f"enc then dec, {threads} threads",
        "conversations": batch,
        "chunk_frames": chunk,
        "ticks": ticks,
        "tick_ms_p50": p["p50"],
        "tick_ms_p95": p["p95"],
        "tick_ms_p99": p["p99"],
        "audio_ms_per_tick": audio_ms,
        "rtf": p["p50"] / audio_ms,
        "realtime": p["p95"] <= audio_ms,
        "peak_rss_bytes": peak_rss_bytes(),
    }


@torch.inference_mode()
def baselines(tok: EncodecTokenizer, frames: int) -> list[dict]:
    pcm = signal(1, frames)
    codes = tok.encode(pcm)
    per_frame = []
    for f in range(frames):
        t, _ = timed(
            lambda f=f: (
                tok.model.encode(pcm[:, None, f * 320 : (f + 1) * 320], bandwidth=tok.bandwidth),
                tok.model.decode(codes[None, ..., f : f + 1], [None]),
            )
        )
        per_frame.append(t)
    p = percentiles(per_frame, 1000)
    rows = [
        {
            "bench": "baseline",
            "path": "transformers per-frame loop, 1 conversation",
            "conversations": 1,
            "chunk_frames": 1,
            "tick_ms_p50": p["p50"],
            "tick_ms_p95": p["p95"],
            "rtf": p["p50"] / FRAME_MS,
            "realtime_conversations": int(FRAME_MS // p["p50"]),
        }
    ]
    batch, seconds = 16, 1
    wav = signal(batch, 75 * seconds)
    t, _ = timed(lambda: tok.model.decode(tok.model.encode(wav[:, None], bandwidth=tok.bandwidth).audio_codes, [None]))
    rows.append(
        {
            "bench": "baseline",
            "path": f"transformers offline batch of {batch} x {seconds} s (no streaming)",
            "conversations": batch,
            "chunk_frames": 75 * seconds,
            "tick_ms_p50": t * 1000,
            "rtf": t / seconds,
            "realtime_conversations": int(batch * seconds / t),
        }
    )
    return rows


def _styles():
    for color in ("C0", "C1", "C2", "C3"):
        for ls in ("-", ":"):
            yield {"color": color, "ls": ls, "marker": "o"}


def plot(rows: list[dict], path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (chunk, threads), style in zip(
        sorted({(r["chunk_frames"], r["threads"]) for r in rows}), _styles(), strict=False
    ):
        pts = sorted(
            (r["conversations"], r["rtf"]) for r in rows if (r["chunk_frames"], r["threads"]) == (chunk, threads)
        )
        ax.plot(*zip(*pts, strict=True), **style, label=f"chunk {chunk}, {threads}")
    ax.axhline(1.0, color="k", ls="--", lw=1, label="real time")
    ax.set_xlabel("conversations in one batch")
    ax.set_ylabel("RTF per conversation (tick time / audio time)")
    ax.set_title("Streaming EnCodec encode + decode, CPU")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def mimi(args) -> None:
    rows = [{**environment(), "quick": args.quick, **r} for r in codec_mimi.compare(args.quick)]
    columns = [("side", "side"), ("conversations", "B"), ("encode_ms_p50", "encode ms p50")]
    columns += [("decode_ms_p50", "decode ms p50"), ("streams_per_core", "real-time streams per core")]
    columns += [("first_encode_ms", "first frame: encode ms"), ("first_decode_ms", "decode ms")]
    columns += [("codes_equal_kyutai", "row 0's codes = Kyutai's"), ("audio_max_diff", "audio max diff")]
    tables = print_table("Streaming Mimi, one 80 ms frame a call, 1 torch thread, same weights", rows, columns)
    save_outputs(args, rows, tables)


def main(argv: list[str] | None = None) -> None:
    p = parser("codec", __doc__.splitlines()[0])
    p.add_argument("--codec", choices=("encodec", "mimi"), default="encodec", help="mimi: `bench/codec_mimi.py`")
    args = p.parse_args(argv)
    if args.codec == "mimi":
        if args.plot == p.get_default("plot"):  # (the table only: beside EnCodec's, not over it)
            args.plot = args.plot.with_name("codec-mimi.png")
        return mimi(args)
    tok = EncodecTokenizer.from_pretrained()
    batches, chunks, ticks_audio_frames = (
        ([1, 16], [1, 4], 24) if args.quick else ([1, 4, 8, 12, 16, 32], [1, 2, 4, 8], 64)
    )
    env = {**environment(), "bandwidth_kbps": tok.bandwidth, "num_codebooks": tok.num_codebooks, "quick": args.quick}

    first = first_chunk(tok, repeats=10 if args.quick else 30)
    stream = []
    pool = ThreadPoolExecutor(2)
    grid = [(b, c, p) for b in batches for c in chunks for p in (None, pool)]
    for b, c, p in tqdm(grid, desc="streaming configs", file=sys.stderr):
        stream.append(streaming(tok, b, c, ticks=max(3, ticks_audio_frames // c), pool=p))
    base = baselines(tok, frames=24 if args.quick else 75)

    tables = []
    tables += print_table(
        "First-chunk decode (1 conversation)",
        first,
        [("path", "path"), ("ms_p50", "p50 ms"), ("ms_p95", "p95 ms"), ("ms_p99", "p99 ms")],
    )
    tables += print_table(
        "Batched streaming encode + decode",
        stream,
        [
            ("threads", "threads"),
            ("conversations", "conversations"),
            ("chunk_frames", "chunk frames"),
            ("tick_ms_p50", "tick p50 ms"),
            ("tick_ms_p95", "tick p95 ms"),
            ("audio_ms_per_tick", "audio ms/tick"),
            ("rtf", "RTF"),
            ("realtime", "real time"),
            ("peak_rss_bytes", "peak RSS B"),
        ],
    )
    tables += print_table(
        "Baselines (transformers EnCodec, same weights)",
        base,
        [
            ("path", "path"),
            ("tick_ms_p50", "time ms p50"),
            ("rtf", "RTF"),
            ("realtime_conversations", "conversations real time"),
        ],
    )
    for threads in sorted({r["threads"] for r in stream}):
        for chunk in chunks:
            rows = [r for r in stream if r["chunk_frames"] == chunk and r["threads"] == threads]
            fits = [r["conversations"] for r in rows if r["realtime"]]
            line = f"{threads}, chunk {chunk}: most conversations real time = {max(fits, default=0)} of {batches}"
            print(line)
            tables.append(f"- {line}")
    rows = [{**env, **r} for r in first + stream + base]
    plot(stream, args.plot)
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
