"""`s2s infer`: a model over a WAV file offline, as Kyutai's `python -m moshi.run_inference`, through the engine.

One duplex conversation hears the whole file; the engine steps it once per input frame from the first (the ticks
go as fast as the machine), and writes the reply audio and each frame's text id, text piece and model codes. With
Moshi's family, frame f's codes come from steps f - 1 (text, semantic codebook) and f (the acoustic ones), so a file
of n frames gives frames 1 .. n - 1, as Kyutai's pipeline (streaming Mimi, `LMGen.step`) gives them.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch

from codec.pcm import load_wav, save_wav
from s2s import AudioEvent, Engine, EngineConfig, SamplingParams
from s2s.build import load_weights


def run(args: argparse.Namespace) -> None:
    try:
        model, tok = load_weights(args.model, args.codec, args.codec is not None)
        sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
        wav = load_wav(args.input)
    except (OSError, ValueError, RuntimeError) as e:  # (soundfile's errors for a file that is no audio)
        raise SystemExit(f"s2s infer: {e}") from None
    if model is None:
        raise SystemExit("s2s infer: --model names no model")
    frames = math.ceil(len(wav) / tok.frame_size)
    wav = np.pad(wav, (0, frames * tok.frame_size - len(wav)))  # (Kyutai pads the last frame with zeros)
    frame_s = tok.frame_size / tok.sample_rate
    engine = Engine(model, tok, EngineConfig(calibration_ticks=0, max_context=round(args.max_context_s / frame_s)))
    steps, audio = infer(engine, wav, frames, sampling)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    save_wav(args.output, audio)
    pieces = model.text_pieces
    if args.json is not None:
        for step in steps:
            if pieces is not None:
                step["text"] = pieces.processor.id_to_piece(step["text_id"])
        args.json.write_text(json.dumps({"model": str(args.model), "frame_s": frame_s, "frames": steps}, indent=1))
    text = pieces.text([s["text_id"] for s in steps]) if pieces is not None else ""
    print(f"{len(steps)} frames, {len(audio) / tok.sample_rate:.2f} s of reply -> {args.output}")
    if text:
        print(f"text: {text.strip()}")


@torch.inference_mode()
def infer(engine: Engine, wav: np.ndarray, frames: int, sampling: SamplingParams) -> tuple[list[dict], np.ndarray]:
    """The conversation's frames (each `{"frame", "text_id"?, "codes"}`) and its reply audio, once the engine has
    stepped it once per input frame."""
    cid = engine.open("duplex", sampling=sampling, admit=False)
    engine.push_audio(cid, wav)
    engine.step()  # (opens it)
    session, queue, audio, steps = engine.sessions[cid], engine.event_queue(cid), [], []
    text_stream = engine.model.config.text_stream
    while True:
        while not queue.empty():
            event = queue.get_nowait()
            if not isinstance(event, AudioEvent):
                continue
            audio.append(event.pcm)
            for i in range(len(event.pcm) // engine.cfg.frame_size):
                f = event.first_frame + i
                codes = [int(c) for c in session.model[f]]
                step = {"frame": f, "codes": codes[1:] if text_stream else codes}
                if text_stream:
                    step["text_id"] = codes[0]
                steps.append(step)
        if session.computed >= frames:
            break
        before = session.computed
        engine.step()
        if session.computed == before:
            raise RuntimeError(f"the engine stopped at step {before} of {frames}")
    return steps, np.concatenate(audio) if audio else np.zeros(0, dtype=np.float32)
