"""A Moshi folder in transformers' layout (`MoshiForConditionalGeneration.save_pretrained`, a sentencepiece text
tokenizer beside it) served: `load_model` gives a MoshiLM whose teacher-forced logits are transformers' own,
`load_tokenizer` the Mimi inside it (its audio encoder), whose codes are transformers'; a missing or misshapen tensor
and a tokenizer of the wrong size are refused by name.

The reference is a tiny random transformers Moshi built here, compared in memory. transformers' forward takes the
streams already delayed, with the initial tokens first (Kyutai's `LMModel.forward` delays them itself): the inputs are
Kyutai's delayed codes less their last step, and the depth decoder reads, at step t, the text and the model's audio of
the delayed step t + 1.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from mimi_reference import signals
from moshi_reference import train_tokenizer
from safetensors.torch import load_file, save_file
from test_mimi import transformers_mimi
from transformers import MoshiConfig, MoshiForConditionalGeneration

from codec import MimiTokenizer, load_tokenizer
from s2s.models.family import load_model
from s2s.models.moshi.config import SamplingDefaults
from s2s.models.moshi.model import MoshiLM

TEXT_VOCAB = 128  # the sentencepiece model's pieces (trainable on the reference's sentences: about 64 to 400)
CODEBOOKS = 8  # dep_q; n_q = 16 (transformers' Moshi has as many user codebooks)
BATCH, STEPS = 2, 16  # (STEPS below the sliding window: transformers' forward does not apply it)
# generation_config.json's sampling, as transformers' Moshi conversion writes it (text `temp`, the depth decoder's)
GENERATION = {"do_sample": True, "temp": 0.6, "top_k": 20, "depth_decoder_config": {"temperature": 0.9, "top_k": 200}}
CPU = torch.device("cpu")


def tiny_moshi(folder: Path, seed: int = 0, codebooks: int = CODEBOOKS) -> MoshiForConditionalGeneration:
    """A tiny random transformers Moshi saved in `folder` with a sentencepiece tokenizer: its audio encoder the tiny
    Mimi of test_mimi (codebooks fitted, so that codes vary), its norms random, its text head and per-codebook
    ("flexible") weights drawn with std 1/sqrt(in) (transformers draws the latter with std 1: logits in the 1e4)."""
    mimi = transformers_mimi(folder / "mimi", seed, num_quantizers=max(8, codebooks))
    config = MoshiConfig(
        vocab_size=TEXT_VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        ffn_dim=2 * 176,
        num_codebooks=codebooks,
        max_position_embeddings=3000,
        sliding_window=3000,
        audio_encoder_config=mimi.config.to_dict(),
        depth_decoder_config={
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "ffn_dim": 2 * 88,
            "max_position_embeddings": codebooks + 1,
            "sliding_window": codebooks,
        },
    )
    torch.manual_seed(seed)
    model = MoshiForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("audio_encoder."):
                continue
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name == "decoder.lm_head.weight" or p.dim() == 3:
                p.normal_(0.0, p.shape[-1] ** -0.5)
        model.audio_encoder.load_state_dict(mimi.state_dict())
    shutil.rmtree(folder / "mimi")
    model.save_pretrained(folder)
    generation = folder / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), **GENERATION}))
    train_tokenizer(folder / "tokenizer.model", TEXT_VOCAB, seed)
    return model


@pytest.fixture(scope="module")
def moshi(tmp_path_factory) -> tuple[Path, MoshiForConditionalGeneration]:
    folder = tmp_path_factory.mktemp("hf_moshi")
    return folder, tiny_moshi(folder)


def load(folder: Path) -> MoshiLM:
    model, codec = load_model(folder, torch.float32, CPU)
    assert isinstance(model, MoshiLM)
    assert codec is not None and (codec.path, codec.config) == (folder, None)  # (Mimi: the folder's audio encoder)
    return model


def transformers_logits(hf: MoshiForConditionalGeneration, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' teacher-forced logits for codes `[B, 1 + 2K, T]`, in `MoshiLM.forward`'s layout: text
    `[B, T, text_card]`, audio `[B, K, T, card]` aligned with the code each predicts (NaN where a delay leaves none)."""
    cfg = hf.config
    k, batch, steps = cfg.num_codebooks, codes.shape[0], codes.shape[-1]
    delays = [0] + 2 * ([0] + [1] * (k - 1))  # transformers' delay pattern (`build_delay_pattern_mask`)
    initial = torch.tensor([cfg.vocab_size] + [cfg.audio_vocab_size] * 2 * k)
    delayed = initial[None, :, None].repeat(batch, 1, steps + 1)
    for s, d in enumerate(delays):
        delayed[:, s, 1 + d :] = codes[:, s, : steps - d]
    inputs = delayed[:, :, :-1]
    out = hf(input_ids=inputs[:, 0], moshi_audio_codes=inputs[:, 1 : 1 + k], user_audio_codes=inputs[:, 1 + k :])
    read = delayed[:, :k, 1:].transpose(1, 2).reshape(batch * steps, k)  # the text and audio 0 .. K-2 of step t + 1
    depth = hf.depth_decoder(
        input_ids=read,
        last_hidden_state=out.last_hidden_state.reshape(batch * steps, 1, -1),
        attention_mask=torch.ones(batch * steps, k, dtype=torch.long),  # (causal under every attention kind)
    )
    logits = depth.logits.view(batch, steps, k, -1).transpose(1, 2)
    audio = torch.full_like(logits, float("nan"))
    for s, d in enumerate(delays[1 : 1 + k]):
        audio[:, s, : steps - d] = logits[:, s, d:]
    return out.logits, audio


def random_codes(text_card: int, card: int, codebooks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, text_card, (BATCH, 1, STEPS), generator=g)
    return torch.cat([text, torch.randint(0, card, (BATCH, 2 * codebooks, STEPS), generator=g)], 1)


def assert_logits_equal(model: MoshiLM, hf: MoshiForConditionalGeneration, seed: int) -> None:
    codes = random_codes(model.moshi.text_card, model.moshi.card, model.moshi.dep_q, seed)
    with torch.no_grad():
        ours = model(codes)
        theirs = transformers_logits(hf, codes)
    for mine, want in zip(ours, theirs, strict=True):
        assert mine.shape == want.shape and torch.equal(mine.isnan(), want.isnan())
        scale = max(1.0, float(want.nan_to_num().abs().max()))  # (about 3 for the text, 8 for the audio here)
        assert float((mine - want).nan_to_num().abs().max()) <= 1e-4 * scale


def test_teacher_forced_logits_equal_transformers(moshi) -> None:
    folder, hf = moshi
    model = load(folder)
    cfg = model.moshi
    assert (cfg.text_card, cfg.card, cfg.dep_q, cfg.n_q) == (TEXT_VOCAB, 64, CODEBOOKS, 2 * CODEBOOKS)
    assert cfg.delays == [0] + 2 * ([0] + [1] * (CODEBOOKS - 1))
    assert cfg.sampling == SamplingDefaults(temp=0.9, temp_text=0.6, top_k=200, top_k_text=20)
    assert_logits_equal(model, hf, seed=1)


def test_sixteen_depformer_codebooks_equal_transformers(tmp_path) -> None:
    """dep_q 16 (n_q 32: transformers' Moshi has as many user codebooks as generated ones)."""
    hf = tiny_moshi(tmp_path, seed=2, codebooks=16)
    model = load(tmp_path)
    assert (model.moshi.dep_q, model.moshi.n_q) == (16, 32)
    assert_logits_equal(model, hf, seed=3)


def test_mimi_from_the_folder_encodes_as_transformers(moshi) -> None:
    folder, hf = moshi
    tok = load_tokenizer(folder)
    assert isinstance(tok, MimiTokenizer)
    assert (tok.frame_size, tok.codebook_size, tok.num_codebooks) == (1920, 64, CODEBOOKS)
    wav = torch.from_numpy(signals(4, 15 * 1920, 11))
    with torch.no_grad():
        want = hf.audio_encoder.encode(wav[:, None], num_quantizers=CODEBOOKS).audio_codes
    for k in range(CODEBOOKS):
        assert want[:, k].unique().numel() >= 8, f"codebook {k} hardly varies"
    assert torch.equal(tok.encode(wav), want)


def test_a_sharded_folder_loads_the_same(moshi, tmp_path) -> None:
    folder, hf = moshi
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    shutil.copy(folder / "tokenizer.model", tmp_path)
    assert_logits_equal(load(tmp_path), hf, seed=2)
    wav = torch.from_numpy(signals(2, 4 * 1920, 12))
    assert torch.equal(load_tokenizer(tmp_path).encode(wav), load_tokenizer(folder).encode(wav))


def copy(source: Path, tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(source, folder)
    return folder


def rewrite(folder: Path, change) -> None:
    state = load_file(folder / "model.safetensors")
    change(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def test_bad_folders_are_named(moshi, tmp_path) -> None:
    source, _ = moshi

    folder = copy(source, tmp_path, "missing")
    rewrite(folder, lambda state: state.pop("depth_decoder.lm_heads.weight"))
    with pytest.raises(ValueError, match=r"missing/model.safetensors: tensor depth_decoder.lm_heads.weight is missing"):
        load(folder)

    folder = copy(source, tmp_path, "shape")
    rewrite(folder, lambda state: state.update({"decoder.lm_head.weight": state["decoder.lm_head.weight"][:-1]}))
    with pytest.raises(ValueError, match=r"shape/model.safetensors: tensor decoder.lm_head.weight has shape"):
        load(folder)

    folder = copy(source, tmp_path, "tokenizer")
    train_tokenizer(folder / "tokenizer.model", TEXT_VOCAB - 8, seed=1)
    with pytest.raises(ValueError, match=r"tokenizer/tokenizer.model: the text tokenizer has 120 pieces .* is 128"):
        load(folder)

    (folder / "tokenizer.model").unlink()
    (folder / "tokenizer.json").write_text("{}")  # (transformers' fast tokenizer, as its Moshi conversion writes)
    with pytest.raises(FileNotFoundError, match=r"tokenizer holds no sentencepiece text tokenizer .*tokenizer.json"):
        load(folder)

    folder = copy(source, tmp_path, "mimi")
    name = next(k for k in sorted(load_file(folder / "model.safetensors")) if k.endswith("q_proj.weight"))
    assert name.startswith("audio_encoder.")
    rewrite(folder, lambda state: state.pop(name))
    with pytest.raises(ValueError, match=f"lacks weight {re.escape(name)}"):
        load_tokenizer(folder)
