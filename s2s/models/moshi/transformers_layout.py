"""transformers' Moshi layout -> Kyutai's: a folder `MoshiForConditionalGeneration.save_pretrained` wrote, read as
the keyword arguments and the state dict of Kyutai's `moshi.models.lm.LMModel`.

The folder holds `config.json` (`model_type` "moshi", the depth decoder's config under `depth_decoder_config`) and
`model.safetensors`, or shards listed by `model.safetensors.index.json`. Only the language model is read. Mimi lies
in the same folder: its config is `config.json[MIMI_CONFIG_KEY]` (a transformers `MimiConfig`, `model_type` "mimi"),
its weights are the tensors named `MIMI_PREFIX` + a transformers `MimiModel` state-dict name.

What transformers' conversion did, undone here: q and k rows of the temporal transformer reordered from Kyutai's
interleaved RoPE pairs (dims 2i, 2i + 1) to rotate-half pairs (i, i + D/2); the packed `in_proj` split into q, k, v
projections; the depformer's per-codebook modules (`in_projs.{i}`, `out_projs.{i}`, `gating.{i}`, `depformer_in.{i}`,
`linears.{i}`) stacked into `[num_codebooks, out, in]` tensors; RMSNorm `alpha` `[1, 1, D]` squeezed to `weight` `[D]`.
Not in transformers' config, so fixed here: the delays as transformers' Moshi applies them (text and each stream's
first codebook undelayed, the other codebooks one step late), and the text padding id, Moshi's 3 (Kyutai's default).
Kyutai's attention `context` is transformers' `sliding_window` (which its forward does not apply).

`read_transformers_folder` gives the folder as the loader's `MoshiFolder`: the sampling defaults from
generation_config.json, the sentencepiece text tokenizer beside the weights, Mimi read from the folder itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from s2s.models.moshi.checkpoint import MoshiFolder

MIMI_PREFIX = "audio_encoder."
MIMI_CONFIG_KEY = "audio_encoder_config"
TEXT_PADDING_ID = 3
TOKENIZER_NAMES = ("tokenizer.model", "tokenizer_spm_32k_3.model")  # sentencepiece: transformers' name, Kyutai's
_NORMS = {1e-8: "rms_norm_f32", 1e-5: "rms_norm"}  # rms_norm_eps -> Kyutai's norm of that eps
_ACTIVATIONS = ("silu", "gelu", "relu", "sigmoid", "tanh")  # the same function under both names


def kyutai_from_transformers(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Kyutai `LMModel` kwargs and state dict (`LMModel.state_dict()` names and shapes, the files' dtype) of the
    Moshi language model in `folder`; Mimi's tensors are left out."""
    folder = Path(folder)
    kwargs = _kyutai_kwargs(folder / "config.json")
    return kwargs, _kyutai_state(kwargs, _Checkpoint(folder))


def read_transformers_folder(folder: Path) -> MoshiFolder:
    """The transformers Moshi folder `folder` as a `MoshiFolder`: its config (sampling defaults from
    generation_config.json), the LM's state converted to Kyutai's layout, its sentencepiece text tokenizer, and the
    folder itself as Mimi's checkpoint (`codec.load_tokenizer` reads a Moshi folder's audio encoder)."""
    from s2s.models.moshi.checkpoint import MoshiFolder
    from s2s.models.moshi.config import MoshiConfig

    folder = Path(folder)
    kwargs = _kyutai_kwargs(folder / "config.json")
    lm_gen_config = _lm_gen_config(folder / "generation_config.json")
    config = MoshiConfig.from_kyutai(kwargs, lm_gen_config, str(folder / "config.json"))
    tokenizer = _text_tokenizer(folder)
    read = _Checkpoint(folder)
    return MoshiFolder(
        folder=folder,
        config=config,
        weights=read.listing,
        tokenizer=tokenizer,
        mimi=folder,
        mimi_config=None,
        state=_kyutai_state(kwargs, read),
    )


def _kyutai_state(kwargs: dict[str, Any], read: _Checkpoint) -> dict[str, torch.Tensor]:
    state = _main_state(kwargs, read) | _depformer_state(kwargs, read)
    if read.unread:
        raise ValueError(f"{read.listing}: tensors no Kyutai LMModel of this config holds: {sorted(read.unread)}")
    return state


def _lm_gen_config(path: Path) -> dict[str, Any] | None:
    """Kyutai's `lm_gen_config` from transformers' generation_config.json at `path`, None without one: the text is
    what the decoder generates (its `temperature`, or `temp` as transformers' Moshi conversion writes Kyutai's 0.7,
    and `top_k`), the audio what `depth_decoder_config` generates. What the file leaves out keeps Kyutai's defaults."""
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    depth = cfg.get("depth_decoder_config") or {}
    found = {
        "temp_text": cfg.get("temperature", cfg.get("temp")),
        "top_k_text": cfg.get("top_k"),
        "temp": depth.get("temperature"),
        "top_k": depth.get("top_k"),
    }
    try:
        return {k: (int if k.startswith("top_k") else float)(v) for k, v in found.items() if v is not None}
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: a temperature or top_k is not a number ({e})") from None


def _text_tokenizer(folder: Path) -> Path:
    """The folder's sentencepiece text tokenizer. transformers' Moshi conversion writes the text tokenizer as a fast
    tokenizer (tokenizer.json), which is not read: the sentencepiece model it came from must lie beside it."""
    for name in TOKENIZER_NAMES:
        if (folder / name).is_file():
            return folder / name
    fast = ""
    if (folder / "tokenizer.json").is_file():
        fast = " (its tokenizer.json, transformers' fast tokenizer, is not read)"
    raise FileNotFoundError(
        f"{folder} holds no sentencepiece text tokenizer{fast}: put the model's sentencepiece file there as "
        + " or ".join(TOKENIZER_NAMES)
    )


def _kyutai_kwargs(path: Path) -> dict[str, Any]:
    """Kyutai's `LMModel` keyword arguments for transformers' `config.json` at `path`, refused where Kyutai's
    model would compute something else."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a transformers Moshi folder")
    cfg = json.loads(path.read_text())
    if cfg.get("model_type") != "moshi":
        raise ValueError(f"{path}: model_type {cfg.get('model_type')!r} is not transformers' Moshi ('moshi')")
    depth = _get(cfg, "depth_decoder_config", path)
    if depth.get("model_type", "moshi_depth") != "moshi_depth":
        raise ValueError(f"{path}: depth_decoder_config's model_type {depth['model_type']!r} is not 'moshi_depth'")
    # transformers keeps rope in `rope_parameters` (v5) or `rope_theta` and `rope_scaling` (v4)
    rope = cfg.get("rope_parameters") or {
        "rope_theta": _get(cfg, "rope_theta", path),
        **(cfg.get("rope_scaling") or {}),
    }
    problems = []
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        problems.append(f"rope {rope} (Kyutai's is plain RoPE)")
    eps = _get(cfg, "rms_norm_eps", path)
    norm = next((name for e, name in _NORMS.items() if math.isclose(e, eps)), None)
    if norm is None or not math.isclose(_get(depth, "rms_norm_eps", path), eps):
        problems.append(f"rms_norm_eps {eps}, depth's {depth['rms_norm_eps']} (must be equal, one of {list(_NORMS)})")
    acts = [_get(c, "hidden_act", path) for c in (cfg, depth)]
    problems += [f"hidden_act {a!r} (one of {_ACTIVATIONS})" for a in acts if a not in _ACTIVATIONS]
    shapes = []  # (hidden size, heads, key/value heads, gating units) of the decoder, then the depth decoder
    for name, c in (("decoder", cfg), ("depth decoder", depth)):
        dim, heads, kv = (_get(c, k, path) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
        if _get(c, "head_dim", path) * heads != dim:
            problems.append(f"{name} head_dim {c['head_dim']} * {heads} heads != hidden_size {dim}")
        if heads % kv:
            problems.append(f"{name} {heads} heads not a multiple of {kv} key/value heads")
        shapes.append((dim, heads, kv, _get(c, "ffn_dim", path) // 2))
    if problems:
        raise ValueError(f"{path}: not expressible as Kyutai's LMModel: " + "; ".join(problems))
    (dim, heads, kv, hidden), (dep_dim, dep_heads, dep_kv, dep_hidden) = shapes
    codebooks = _get(cfg, "num_codebooks", path)
    dim_feedforward = _kyutai_feedforward(dim, hidden, path)
    hidden_scale = dim_feedforward / dim
    if int(hidden_scale * dim) != dim_feedforward:  # LMModel takes int(hidden_scale * dim)
        hidden_scale = math.nextafter(hidden_scale, math.inf)
    return {
        "dim": dim,
        "text_card": _get(cfg, "vocab_size", path),
        "existing_text_padding_id": TEXT_PADDING_ID,
        "n_q": 2 * codebooks,
        "dep_q": codebooks,
        "card": _get(cfg, "audio_vocab_size", path),
        "num_heads": heads,
        "num_layers": _get(cfg, "num_hidden_layers", path),
        "hidden_scale": hidden_scale,
        "causal": True,
        "layer_scale": None,
        "context": _get(cfg, "sliding_window", path),
        "max_period": _get(rope, "rope_theta", path),
        "gating": acts[0],
        "norm": norm,
        "positional_embedding": "rope",
        "kv_repeat": heads // kv,
        "depformer_dim": dep_dim,
        "depformer_dim_feedforward": _kyutai_feedforward(dep_dim, dep_hidden, path),
        "depformer_num_heads": dep_heads,
        "depformer_num_layers": _get(depth, "num_hidden_layers", path),
        "depformer_layer_scale": None,
        "depformer_multi_linear": True,
        "depformer_gating": acts[1],
        "depformer_pos_emb": "none",
        "depformer_weights_per_step": True,
        "depformer_kv_repeat": dep_heads // dep_kv,
        "delays": [0] + 2 * ([0] + [1] * (codebooks - 1)),
    }


def _get(cfg: dict[str, Any], key: str, path: Path) -> Any:
    """`cfg[key]`, which must be set (`path`: the config file, for the error)."""
    if cfg.get(key) is None:
        raise ValueError(f"{path}: {key} is missing")
    return cfg[key]


def _gating_units(dim: int, dim_feedforward: int) -> int:
    """The hidden units of Kyutai's gated feed-forward (`ActivationGating`) for `dim_feedforward`."""
    return 21 * dim // 8 if dim_feedforward == 4 * dim else 2 * dim_feedforward // 3


def _kyutai_feedforward(dim: int, hidden: int, path: Path) -> int:
    """A `dim_feedforward` for which Kyutai's gated feed-forward has `hidden` units."""
    for dim_feedforward in ((3 * hidden + 1) // 2, (3 * hidden + 2) // 2, 4 * dim):
        if _gating_units(dim, dim_feedforward) == hidden:
            return dim_feedforward
    raise ValueError(f"{path}: ffn_dim {2 * hidden} at hidden size {dim} is no width Kyutai's gating builds")


class _Checkpoint:
    """The tensors of a safetensors checkpoint, one file or shards listed by an index: read by name with their shape
    checked; `unread` holds the names, Mimi's aside, not read yet."""

    def __init__(self, folder: Path):
        index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
        if index.is_file():
            self.listing = index
            self.files = {name: folder / shard for name, shard in json.loads(index.read_text())["weight_map"].items()}
        elif single.is_file():
            self.listing = single
            with safe_open(single, "pt") as f:
                self.files = dict.fromkeys(f.keys(), single)
        else:
            raise FileNotFoundError(f"{folder} holds neither {single.name} nor {index.name}")
        self.opened: dict[Path, Any] = {}
        self.unread = {name for name in self.files if not name.startswith(MIMI_PREFIX)}

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        path = self.files.get(name)
        if path is None:
            raise ValueError(f"{self.listing}: tensor {name} is missing")
        if path not in self.opened:
            if not path.is_file():
                raise FileNotFoundError(f"{self.listing} puts tensor {name} in {path.name}, which is missing")
            self.opened[path] = safe_open(path, "pt")
        found = tuple(self.opened[path].get_slice(name).get_shape())
        if found != shape:
            raise ValueError(f"{path}: tensor {name} has shape {found}, expected {shape}")
        self.unread.discard(name)
        return self.opened[path].get_tensor(name)


def _half_to_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows `[heads * hd, in]`, each head's from rotate-half pairs (i, i + hd/2) back to Kyutai's interleaved
    pairs (2i, 2i + 1): row 2i + c <- row c * hd/2 + i."""
    hd = weight.shape[0] // heads
    return weight.view(heads, 2, hd // 2, -1).transpose(1, 2).reshape(weight.shape)


def _main_state(kw: dict[str, Any], read: _Checkpoint) -> dict[str, torch.Tensor]:
    """Embeddings, the temporal transformer, its output norm and the text head."""
    dim, heads, hd = kw["dim"], kw["num_heads"], kw["dim"] // kw["num_heads"]
    kv_dim, hidden = heads // kw["kv_repeat"] * hd, _gating_units(dim, int(kw["hidden_scale"] * dim))
    state = {
        "text_emb.weight": read("decoder.model.embed_tokens.weight", (kw["text_card"] + 1, dim)),
        "text_linear.weight": read("decoder.lm_head.weight", (kw["text_card"], dim)),
        "out_norm.alpha": read("decoder.model.norm.weight", (dim,)).view(1, 1, dim),
    }
    state |= {f"emb.{j}.weight": read(f"embed_tokens.{j}.weight", (kw["card"] + 1, dim)) for j in range(kw["n_q"])}
    for i in range(kw["num_layers"]):
        hf, ky = f"decoder.model.layers.{i}.", f"transformer.layers.{i}."
        q = _half_to_interleaved(read(hf + "self_attn.q_proj.linear.weight", (dim, dim)), heads)
        k = _half_to_interleaved(read(hf + "self_attn.k_proj.linear.weight", (kv_dim, dim)), heads // kw["kv_repeat"])
        v = read(hf + "self_attn.v_proj.linear.weight", (kv_dim, dim))
        state[ky + "self_attn.in_projs.0.weight"] = torch.cat([q, k, v])
        state[ky + "self_attn.out_projs.0.weight"] = read(hf + "self_attn.o_proj.linear.weight", (dim, dim))
        state[ky + "norm1.alpha"] = read(hf + "input_layernorm.weight", (dim,)).view(1, 1, dim)
        state[ky + "norm2.alpha"] = read(hf + "post_attention_layernorm.weight", (dim,)).view(1, 1, dim)
        state[ky + "gating.linear_in.weight"] = read(hf + "mlp.fc1.weight", (2 * hidden, dim))
        state[ky + "gating.linear_out.weight"] = read(hf + "mlp.fc2.weight", (dim, hidden))
    return state


def _depformer_state(kw: dict[str, Any], read: _Checkpoint) -> dict[str, torch.Tensor]:
    """The depformer: its input projections and embeddings, transformer (weights per codebook) and heads."""
    steps, dim, dep = kw["dep_q"], kw["dim"], kw["depformer_dim"]
    kv_dim, hidden = dep // kw["depformer_kv_repeat"], _gating_units(dep, kw["depformer_dim_feedforward"])

    def per_step(name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        return read(name, (steps, *shape)).unbind()

    state = {"depformer_text_emb.weight": read("depth_decoder.text_embed_tokens.weight", (kw["text_card"] + 1, dep))}
    for j in range(steps - 1):
        state[f"depformer_emb.{j}.weight"] = read(f"depth_decoder.embed_tokens.{j}.weight", (kw["card"] + 1, dep))
    for i, w in enumerate(per_step("depth_decoder.input_projections.weight", (dep, dim))):
        state[f"depformer_in.{i}.weight"] = w
    for i, w in enumerate(per_step("depth_decoder.lm_heads.weight", (kw["card"], dep))):
        state[f"linears.{i}.weight"] = w
    for n in range(kw["depformer_num_layers"]):
        hf, ky = f"depth_decoder.layers.{n}.", f"depformer.layers.{n}."
        qkv = zip(
            per_step(hf + "self_attn.q_proj.linear.weight", (dep, dep)),
            per_step(hf + "self_attn.k_proj.linear.weight", (kv_dim, dep)),
            per_step(hf + "self_attn.v_proj.linear.weight", (kv_dim, dep)),
            strict=True,
        )
        for i, (q, k, v) in enumerate(qkv):
            state[ky + f"self_attn.in_projs.{i}.weight"] = torch.cat([q, k, v])
        for i, w in enumerate(per_step(hf + "self_attn.o_proj.linear.weight", (dep, dep))):
            state[ky + f"self_attn.out_projs.{i}.weight"] = w
        state[ky + "norm1.alpha"] = read(hf + "input_layernorm.weight", (dep,)).view(1, 1, dep)
        state[ky + "norm2.alpha"] = read(hf + "post_attention_layernorm.weight", (dep,)).view(1, 1, dep)
        fc1 = per_step(hf + "mlp.fc1.weight", (2 * hidden, dep))
        fc2 = per_step(hf + "mlp.fc2.weight", (dep, hidden))
        for i, (w_in, w_out) in enumerate(zip(fc1, fc2, strict=True)):
            state[ky + f"gating.{i}.linear_in.weight"] = w_in
            state[ky + f"gating.{i}.linear_out.weight"] = w_out
    return state
