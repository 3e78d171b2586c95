"""`s2s bench codec --codec mimi`: Kyutai's streaming Mimi against `codec.MimiTokenizer`, side by side in one run on
the same weights (Kyutai's default Mimi, 8 codebooks, seeded random weights made to carry a signal).

Kyutai's side runs in `.venv-moshi` (`bench/mimi_kyutai.py`): its `MimiModel` in `with mimi.streaming(B)`, one 80 ms
frame a call. This side: `streaming_encoder(B)` and `streaming_decoder(B)` pushed one frame a call. Both at B = 1, 4
and 16 (`--quick`: 1 and 4), on `--threads` torch threads (1: streams per core). Per side and B: each frame's encode and
decode time (p50 after the first frames), the real-time streams per core that makes (B x 80 ms over encode + decode,
over the threads), the first frame's encode and decode on a fresh stream, and whether row 0's codes equal Kyutai's
and its audio is within 1e-4 of Kyutai's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import percentiles

ROOT = Path(__file__).resolve().parents[1]
KYUTAI_PYTHON = ROOT / ".venv-moshi" / "bin" / "python"
WARM = 3  # frames each side streams before its times count


def kyutai(out: Path, batches: list[int], frames: int, threads: int) -> dict:
    if not KYUTAI_PYTHON.exists():
        raise SystemExit(f"{KYUTAI_PYTHON} is missing: run scripts/setup_moshi_client.sh")
    args = [str(KYUTAI_PYTHON), str(ROOT / "bench" / "mimi_kyutai.py"), str(out), "--frames", str(frames)]
    subprocess.run([*args, "--threads", str(threads), "--batches", *map(str, batches)], check=True)
    return json.loads((out / "kyutai.json").read_text())


@torch.inference_mode()
def ours(weights: Path, wav: np.ndarray, threads: int) -> dict:
    from codec import MimiTokenizer

    torch.set_num_threads(threads)
    tok = MimiTokenizer.from_pretrained(weights, num_codebooks=8)
    rows, fs = wav.shape[0], tok.frame_size
    enc, dec = tok.streaming_encoder(rows), tok.streaming_decoder(rows)
    encode_s, decode_s, codes, audio = [], [], [], []
    for f in range(wav.shape[1] // fs):
        start = time.perf_counter()
        c = torch.stack(enc.push(list(wav[:, f * fs : (f + 1) * fs])))
        middle = time.perf_counter()
        a = dec.push(c)
        encode_s.append(middle - start)
        decode_s.append(time.perf_counter() - middle)
        codes.append(c[0].numpy())
        audio.append(a[0].numpy())
    codes, audio = np.concatenate(codes, -1), np.concatenate(audio)
    return {"encode_s": encode_s, "decode_s": decode_s, "codes": codes, "audio": audio}


def row(side: str, batch: int, run: dict, threads: int, reference: dict) -> dict:
    enc, dec = percentiles(run["encode_s"][WARM:], 1000), percentiles(run["decode_s"][WARM:], 1000)
    frame_ms = 80.0
    codes, audio = np.asarray(run["codes"]), np.asarray(run["audio"])
    return {
        "bench": "codec_mimi",
        "side": side,
        "conversations": batch,
        "threads": threads,
        "encode_ms_p50": enc["p50"],
        "decode_ms_p50": dec["p50"],
        "streams_per_core": batch * frame_ms / (enc["p50"] + dec["p50"]) / threads,
        "first_encode_ms": run["encode_s"][0] * 1000,
        "first_decode_ms": run["decode_s"][0] * 1000,
        "codes_equal_kyutai": bool(np.array_equal(codes, np.asarray(reference["codes"]))),
        "audio_max_diff": float(np.abs(audio - np.asarray(reference["audio"])).max()),
    }


def compare(quick: bool, threads: int = 1) -> list[dict]:
    """Rows for `bench/codec_bench.py`'s table: both at B = 1, 4 and 16 (Kyutai's `MimiModel` batches too)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from mimi_reference import signals  # the reference's signals: row 0 is the same at every B

    frames = 12 if quick else 40
    with tempfile.TemporaryDirectory(prefix="mimi-bench-") as tmp:
        out = Path(tmp)
        batches = [1, 4] if quick else [1, 4, 16]
        theirs = kyutai(out, batches, frames, threads)
        fs = theirs["frame_size"]
        reference = theirs["batches"]["1"]
        rows = [row("Kyutai moshi 0.2.13", int(b), run, threads, reference) for b, run in theirs["batches"].items()]
        for b in batches:
            wav = signals(b, frames * fs, 0)
            rows.append(row("s2s MimiTokenizer", b, ours(out / "mimi.safetensors", wav, threads), threads, reference))
    return rows
