"""Reading Mimi's weights: Kyutai's safetensors file (the names of Kyutai's `MimiModel.state_dict()`, or the older
ones its load hooks still accept) with an optional Kyutai config JSON (given, or beside it), or a folder
transformers' `MimiModel` saved (config.json + model.safetensors, flat names as transformers writes them, or nested
as it holds them), or the audio encoder in a folder transformers' `MoshiForConditionalGeneration` saved (its config
under config.json's `audio_encoder_config`, its tensors named `audio_encoder.` + a `MimiModel`'s). All come out as
Kyutai's names, checked against the model's: a missing or misshapen weight is a ValueError that names it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from codec.mimi.config import MimiConfig

# Kyutai's older names for the same tensors (its load hooks map them)
_KYUTAI_LEGACY = [
    (re.compile(r"\.self_attn\.in_proj_weight$"), ".self_attn.in_projs.0.weight"),
    (re.compile(r"\.self_attn\.in_proj\.weight$"), ".self_attn.in_projs.0.weight"),
    (re.compile(r"\.self_attn\.out_proj\.weight$"), ".self_attn.out_projs.0.weight"),
    (re.compile(r"\._codebook\.(embed_avg|embed_sum)$"), "._codebook.embedding_sum"),
    (re.compile(r"\._codebook\.cluster_size$"), "._codebook.cluster_usage"),
]
# a transformers Moshi folder's Mimi: config.json's key for its config, its tensors' prefix
_MOSHI_MIMI_CONFIG, _MOSHI_MIMI_PREFIX = "audio_encoder_config", "audio_encoder."
# transformers' nested names (as a MimiModel holds them) -> its flat ones (as it writes them)
_HF_NESTED = [
    ("encoder.encoder_seanet.", "encoder."),
    ("encoder.encoder_transformer.", "encoder_transformer."),
    ("encoder.downsample.", "downsample."),
    ("decoder.decoder_seanet.", "decoder."),
    ("decoder.decoder_transformer.", "decoder_transformer."),
    ("decoder.upsample.", "upsample."),
]
_HF_LAYER = {
    "norm1.weight": "input_layernorm.weight",
    "norm1.bias": "input_layernorm.bias",
    "norm2.weight": "post_attention_layernorm.weight",
    "norm2.bias": "post_attention_layernorm.bias",
    "linear1.weight": "mlp.fc1.weight",
    "linear2.weight": "mlp.fc2.weight",
    "layer_scale_1.scale": "self_attn_layer_scale.scale",
    "layer_scale_2.scale": "mlp_layer_scale.scale",
    "self_attn.out_projs.0.weight": "self_attn.o_proj.weight",
}


def read_checkpoint(path: str | Path, config: str | Path | dict | None = None) -> tuple[MimiConfig, TensorSource]:
    """(config, a source of tensors by Kyutai's names) for Kyutai's file or transformers' folder at `path` (a
    `MimiModel`'s, or a `MoshiForConditionalGeneration`'s: its audio encoder). A file's config is `config`, else the
    Kyutai config JSON `NAME.json` beside `NAME.safetensors`, else Kyutai's Mimi."""
    path = Path(path)
    if path.is_dir():
        if config is not None:
            raise ValueError("a transformers Mimi folder brings its own config.json: pass no config")
        return _read_transformers(path)
    if not path.is_file():
        raise FileNotFoundError(f"no Mimi checkpoint at {path}: neither a safetensors file nor a folder")
    if config is None and path.with_suffix(".json").is_file():
        config = path.with_suffix(".json")  # (as `MimiTokenizer.save_pretrained` writes it)
    if isinstance(config, str | Path):
        config = json.loads(Path(config).read_text())
    cfg = MimiConfig.from_kyutai(config)
    tensors = load_file(str(path))
    for pattern, new in _KYUTAI_LEGACY:
        tensors = {pattern.sub(new, k): v for k, v in tensors.items()}
    return cfg, tensors


def _read_transformers(folder: Path) -> tuple[MimiConfig, _FromTransformers]:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} holds no config.json: not a transformers Mimi folder")
    config, prefix = json.loads(config_file.read_text()), ""
    if config.get("model_type") == "moshi":  # transformers' Moshi: its Mimi is its audio encoder
        config, prefix = config.get(_MOSHI_MIMI_CONFIG), _MOSHI_MIMI_PREFIX
        if not isinstance(config, dict):
            raise ValueError(f"{config_file}: a Moshi config without {_MOSHI_MIMI_CONFIG}, its Mimi's config")
    cfg = MimiConfig.from_transformers(config)
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # (a Moshi's shards: those that hold its Mimi's tensors)
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / f for f in sorted({f for k, f in weight_map.items() if k.startswith(prefix)})]
    else:
        files = [folder / "model.safetensors"]
    if not all(f.is_file() for f in files):
        raise FileNotFoundError(f"{folder} lacks its weights: {[str(f) for f in files if not f.is_file()]}")
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as tensors:
            hf.update({k[len(prefix) :]: tensors.get_tensor(k) for k in tensors.keys() if k.startswith(prefix)})
    for nested, flat in _HF_NESTED:
        hf = {flat + k[len(nested) :] if k.startswith(nested) else k: v for k, v in hf.items()}
    return cfg, _FromTransformers(hf, cfg, prefix)


class _FromTransformers:
    """transformers' tensors, read by Kyutai's names (`get`): renamed, and the attention's q, k, v projections
    joined back into Kyutai's one, q and k rows back in RoPE's interleaved order (transformers rotates halves).
    `prefix`: what the files' names had before transformers' (for errors)."""

    def __init__(self, hf: dict[str, torch.Tensor], cfg: MimiConfig, prefix: str = ""):
        self.hf, self.heads, self.prefix = hf, cfg.num_heads, prefix

    def hf_names(self, name: str) -> list[str]:
        if m := re.fullmatch(r"(\w+_transformer)\.transformer\.layers\.(\d+)\.(.+)", name):
            prefix = f"{m[1]}.layers.{m[2]}."
            if m[3] == "self_attn.in_projs.0.weight":
                return [f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"]
            return [prefix + _HF_LAYER.get(m[3], m[3])]
        if m := re.fullmatch(r"quantizer\.rvq_(first|rest)\.(.+)", name):
            group = "semantic" if m[1] == "first" else "acoustic"
            rest = re.sub(r"vq\.layers\.(\d+)\._codebook\.embedding_sum", r"layers.\1.codebook.embed_sum", m[2])
            rest = re.sub(r"vq\.layers\.(\d+)\._codebook\.", r"layers.\1.codebook.", rest)
            return [f"quantizer.{group}_residual_vector_quantizer.{rest}"]
        name = re.sub(r"(conv|convtr)\.\1\.\1\.", "conv.", name)  # the resampling's
        return [re.sub(r"\.(conv\.conv|convtr\.convtr)\.", ".conv.", name.replace(".model.", ".layers."))]

    def get(self, name: str) -> torch.Tensor:
        names = self.hf_names(name)
        missing = [n for n in names if n not in self.hf]
        if missing:
            raise ValueError(f"transformers Mimi checkpoint lacks weight {self.prefix}{missing[0]} (for {name})")
        if len(names) == 1:
            return self.hf[names[0]]
        q, k, v = (self.hf[n] for n in names)
        if not q.shape == k.shape == v.shape or q.dim() != 2 or q.shape[0] % (2 * self.heads):
            names = [self.prefix + n for n in names]
            raise ValueError(f"transformers Mimi checkpoint has misshapen weights {names}: {[tuple(q.shape)] * 3}")
        return torch.cat([self._interleave(q), self._interleave(k), v])

    def _interleave(self, w: torch.Tensor) -> torch.Tensor:
        rows, cols = w.shape
        return w.view(self.heads, 2, rows // self.heads // 2, cols).transpose(1, 2).reshape(rows, cols)


TensorSource = dict[str, torch.Tensor] | _FromTransformers


def gather_weights(expected: dict[str, torch.Tensor], source: TensorSource, where: str) -> dict[str, torch.Tensor]:
    """The tensors of `source` for every name of `expected` (a state dict), each checked for its shape."""
    out = {}
    for name, like in expected.items():
        t = source.get(name)
        if t is None:
            raise ValueError(f"{where} lacks weight {name}")
        if tuple(t.shape) != tuple(like.shape):
            raise ValueError(f"{where} has weight {name} of shape {tuple(t.shape)}, expected {tuple(like.shape)}")
        out[name] = t.to(torch.float32)
    return out
