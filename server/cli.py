"""The `s2s` command: `s2s roundtrip` (the codec on real speech) and `s2s bench NAME` (a benchmark in bench/)."""

from __future__ import annotations

import argparse
import pkgutil
import runpy
import sys
import time
from pathlib import Path

import numpy as np
import torch


def _bench_names() -> list[str]:
    import bench

    return sorted(
        m.name.removesuffix("_bench") for m in pkgutil.iter_modules(bench.__path__) if m.name.endswith("_bench")
    )


def roundtrip(args: argparse.Namespace) -> None:
    """Real speech through the streaming encoder (80 ms blocks, as a client sends) and decoder (frame by frame)."""
    from codec import EncodecTokenizer
    from server.audio import load_wav, save_wav
    from server.speech import speech

    tok = EncodecTokenizer.from_pretrained(args.codec, bandwidth=args.bandwidth)
    weights = f"checkpoint {args.codec}" if args.codec else "seeded random weights (offline default: output is noise)"
    wav, source = (load_wav(args.wav), str(args.wav)) if args.wav else speech(args.text)
    wav = wav[: len(wav) // tok.frame_size * tok.frame_size]
    print(f"codec: EnCodec 24 kHz, {tok.bandwidth} kbps, {tok.num_codebooks} codebooks, {weights}")
    print(f"input: {len(wav) / tok.sample_rate:.2f} s of speech from {source}")

    enc, dec = tok.streaming_encoder(1), tok.streaming_decoder(1)
    codes, audio, first_out, t0 = [], [], None, time.perf_counter()
    for a in range(0, len(wav), 1920):
        new = enc.push(wav[None, a : a + 1920])[0]
        for f in range(new.shape[-1]):
            frame = new[:, f : f + 1]
            codes.append(frame)
            audio.append(dec.push(frame[None])[0])
            if first_out is None:
                first_out = time.perf_counter() - t0
    elapsed = time.perf_counter() - t0
    codes_t = torch.cat(codes, -1)[None]
    stream = torch.cat(audio).numpy()
    offline_codes = tok.encode(wav)
    offline = tok.decode(offline_codes)[0].numpy()
    settled = (tok.decoder_warmup_frames - 1) * tok.frame_size
    print(
        f"codes: {codes_t.shape[-1]} frames x {tok.num_codebooks} codebooks; first frames of codebook 0: "
        f"{codes_t[0, 0, :10].tolist()}"
    )
    print(f"streaming codes equal offline encode(): {bool(torch.equal(codes_t, offline_codes))}")
    print(
        f"streaming audio vs offline decode(): max |diff| {np.abs(stream[settled:] - offline[settled:]).max():.2e} "
        f"(from frame {tok.decoder_warmup_frames - 1} on)"
    )
    print(
        f"first audio out {first_out * 1000:.1f} ms after the first block went in; "
        f"{elapsed:.2f} s compute for {len(wav) / tok.sample_rate:.2f} s of audio "
        f"(RTF {elapsed / (len(wav) / tok.sample_rate):.2f})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_wav(args.out, stream)
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="s2s", description="Speech-to-speech serving engine")
    sub = p.add_subparsers(dest="command", required=True)
    rt = sub.add_parser("roundtrip", help="stream real speech through the codec and back")
    rt.add_argument("--codec", type=Path, default=None, help="Hugging Face EnCodec 24 kHz folder (default: seeded)")
    rt.add_argument("--bandwidth", type=float, default=1.5, help="kbps: 1.5, 3, 6, 12 or 24")
    rt.add_argument("--wav", type=Path, default=None, help="speech to use instead of espeak-ng's")
    rt.add_argument("--text", default="Hello there. This is a test of the speech codec.", help="what espeak-ng says")
    rt.add_argument("--out", type=Path, default=Path("out/roundtrip.wav"), help="where to write the decoded audio")
    b = sub.add_parser("bench", help="run a benchmark from bench/ (s2s bench NAME --help)")
    b.add_argument("name", help="one of: " + ", ".join(_bench_names()))
    b.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command == "roundtrip":
        roundtrip(args)
    elif args.command == "bench":
        if args.name not in _bench_names():
            p.error(f"unknown benchmark {args.name!r}; choose from {', '.join(_bench_names())}")
        sys.argv = [f"s2s bench {args.name}", *args.rest]
        runpy.run_module(f"bench.{args.name}_bench", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
