"""`s2s roundtrip`: real speech through the streaming codec (EnCodec or Mimi, `codec.load_tokenizer`) and back."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from codec import load_tokenizer
from codec.pcm import load_wav, save_wav
from s2s.models.shipped import shipped
from speech.sample import speech

BLOCK_S = 0.08  # what Moshi's client sends a message


def run(args: argparse.Namespace) -> None:
    """Real speech through the streaming encoder (blocks of the codec's whole frames nearest 80 ms, as a client
    sends) and decoder (frame by frame)."""
    codec = args.codec or (None if args.random_weights else shipped("codec"))
    try:
        tok = load_tokenizer(codec, bandwidth=args.bandwidth)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--codec: {e}") from None
    weights = f"checkpoint {codec}" if codec else "seeded random weights (output is noise)"
    wav, source = (load_wav(args.wav), str(args.wav)) if args.wav else speech(args.text)
    wav = wav[: len(wav) // tok.frame_size * tok.frame_size]
    print(f"codec: {tok.describe()}, {weights}")
    print(f"input: {len(wav) / tok.sample_rate:.2f} s of speech from {source}")

    enc, dec = tok.streaming_encoder(1), tok.streaming_decoder(1)
    codes, audio, first_out, t0 = [], [], None, time.perf_counter()
    block = max(1, round(BLOCK_S * tok.frame_rate)) * tok.frame_size
    for a in range(0, len(wav), block):
        new = enc.push(wav[None, a : a + block])[0]
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
