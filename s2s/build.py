"""An engine built from folders: a model folder (or a seeded preset), a codec (EnCodec's folder, Mimi's file or folder:
`codec.load_tokenizer`; or a seeded EnCodec), and a folder of voice prompts. What `s2s serve`, `s2s demo` and the
benchmarks serve; the shipped weights are the default."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from codec import Tokenizer, load_tokenizer
from codec.pcm import load_wav
from s2s.engine.config import EngineConfig
from s2s.engine.engine import Engine
from s2s.engine.prompts import Prompt
from s2s.models.config import ModelConfig
from s2s.models.family import StepModel, load_model
from s2s.models.model import S2SModel
from s2s.models.moshi.persona import persona_prompt
from s2s.models.shipped import shipped

AUDIO_SUFFIXES = {".wav", ".flac", ".ogg"}


def weight_folders(
    model: Path | None, codec: Path | None, preset: str | None = None, random: bool = False
) -> tuple[Path | None, Path | None]:
    """The codec and model paths to load: given ones, else the shipped ones; None for seeded random weights
    (`random`, or a `preset` without a model folder: benchmarks and tests keep their presets)."""
    random = random or (preset is not None and model is None)
    return codec or (None if random else shipped("codec")), model or (None if random else shipped("model"))


def load_prompts(folder: str | Path, tok: Tokenizer, model: StepModel | None = None) -> dict[str, np.ndarray | Prompt]:
    """name -> codes [K, P] for each audio file whose stem is a plain name (letters, digits, underscore). For a
    model with a text stream (Moshi's family), PersonaPlex's persona prompts: `NAME.wav` the voice and `NAME.txt` the
    role text, either one alone or both."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"prompt folder {folder} does not exist")
    persona = model is not None and model.config.text_stream
    audio = {p.stem: p for p in sorted(folder.iterdir()) if p.suffix.lower() in AUDIO_SUFFIXES}
    texts = {p.stem: p for p in sorted(folder.iterdir()) if p.suffix == ".txt"} if persona else {}
    voices: dict[str, np.ndarray | Prompt] = {}
    for name in sorted(audio.keys() | texts.keys()):
        if not name.isidentifier():
            raise ValueError(f"voice prompt {name}: names must be plain (letters, digits, underscore)")
        wav = load_wav(audio[name]) if name in audio else None
        if persona:
            text = texts[name].read_text() if name in texts else None
            voices[name] = persona_prompt(model.config, tok, model.text_pieces, wav, text)
        else:
            voices[name] = tok.encode(wav)[0].cpu().numpy()
    return voices


def load_codec(
    codec: Path | None,
    bandwidth: float = 1.5,
    device: torch.device | None = None,
    model: StepModel | None = None,
    config: Path | None = None,
) -> Tokenizer:
    """The codec at `codec` (`codec.load_tokenizer`: EnCodec's folder, Mimi's file or folder; None: a seeded
    EnCodec; `bandwidth`: EnCodec's; `config`: a Mimi file's): its frame size is the engine's
    (`EngineConfig.frame_size`). With a `model`, a Mimi gives as many codebooks as the model's steps hold."""
    codebooks = model.config.audio_codebooks if model is not None else 8
    return load_tokenizer(codec, bandwidth, codebooks, config, device=device or torch.device("cpu"))


def load_weights(
    model: Path | None,
    codec: Path | None,
    codec_given: bool,
    bandwidth: float = 1.5,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[StepModel | None, Tokenizer]:
    """The model in the folder `model` (`s2s.models.family.load_model`; None: a preset's, built later) and its
    codec: `codec` if it was given (`codec_given`), else the one the model folder holds (Moshi's Mimi), else
    `codec` (the shipped one)."""
    device = device or torch.device("cpu")
    loaded, own = load_model(model, dtype, device) if model else (None, None)
    if own is not None and not codec_given:
        return loaded, load_codec(own.path, bandwidth, device, loaded, own.config)
    return loaded, load_codec(codec, bandwidth, device, loaded)


def build_engine(
    config: EngineConfig,
    tok: Tokenizer,
    model: StepModel | None = None,
    preset: str | None = None,
    prompts: Path | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> Engine:
    """The engine over `model` (`load_weights`; None: `preset`'s seeded weights, `small` by default) and the codec
    `tok`, with the voice prompts of the `prompts` folder registered. A preset takes the codec's codebooks (their
    count and size)."""
    device = device or torch.device("cpu")
    if model is None:
        shape = ModelConfig.preset(preset or "small", num_codebooks=tok.num_codebooks, codebook_size=tok.codebook_size)
        model = S2SModel.from_seed(shape, seed=0, dtype=dtype, device=device)
    engine = Engine(model, tok, config)
    for name, codes in (load_prompts(prompts, tok, model) if prompts else {}).items():
        engine.add_voice(name, codes)
    return engine
