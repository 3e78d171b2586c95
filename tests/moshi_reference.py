"""Kyutai's own Moshi LM (moshi 0.2.13) as the reference for Moshi serving: run in .venv-moshi, not the main venv.

    .venv-moshi/bin/python tests/moshi_reference.py SPEC.json OUT_DIR

SPEC.json: {"configs": [{"name": str, "seed": int, "lm": {...LMModel kwargs, as moshi.models.loaders._lm_kwargs (see
`tiny_lm_kwargs`)...}, "lm_gen_config": {...} (optional, default `LM_GEN_CONFIG`), "batch": int, "steps": int,
"frames": int (optional, T of the teacher-forced codes, default `steps`), "mimi_config": {...as
loaders._mimi_config (see `tiny_mimi_config`)...} (optional)}, ...]}. For each configuration, OUT_DIR/<name>/ gets

- a checkpoint folder in Kyutai's layout (the folder itself):
  - `config.json`: the LM kwargs plus `moshi_name`, `tokenizer_name`, `lm_gen_config` and, with a Mimi,
    `mimi_name` and `mimi_config_name`, as `CheckpointInfo.from_hf_repo` reads them;
  - `model.safetensors`: `LMModel(**lm).state_dict()`, fp32, of a seeded random LMModel: Kyutai's init
    (`LMModel._init_weights`), then every weight scaled up (`randomize`) so that the logits are spread out and the
    greedy tokens vary from step to step;
  - `tokenizer.model`: a sentencepiece unigram model trained here on seeded English sentences, with exactly
    `lm["text_card"]` pieces; id 0 `<unk>` (Kyutai's end-of-text-padding id, `existing_text_end_padding_id`), 1
    `<s>`, 2 `</s>`, 3 `<pad>` (Kyutai's text padding id, `existing_text_padding_id`), as in Kyutai's tokenizers;
  - with "mimi_config": `mimi.safetensors` (a seeded random Mimi, randomized as tests/mimi_reference.py does) and
    `mimi_config.json`; `quantizer.bins` must equal `lm["card"]` and `quantizer.n_q` cover
    `max(dep_q, n_q - dep_q)`, the codebooks `CheckpointInfo.get_mimi` sets.
  `CheckpointInfo.from_hf_repo` takes a Hub repository id only (a local path fails Hub's repo-id validation), but
  with `config_path` and every file given it never touches the Hub: `checkpoint_info(folder)` loads a folder so, as
  `moshi.server --config-path F --moshi-weight F --mimi-weight F --tokenizer F` does, plus `mimi_config_path` (the
  server has no flag for it: it would fetch config.json's `mimi_config_name` from `--hf-repo`);
- `ref.npz`, all from the reloaded folder (`checkpoint_info(folder).get_moshi(dtype=torch.float32)`), CPU, fp32
  (tokens int64, masks bool):
  - `codes` [B, 1 + n_q, T]: random teacher-forced codes (text in [0, text_card), audio in [0, card));
  - `text_logits` [B, 1, T, text_card], `text_mask` [B, 1, T], `logits` [B, dep_q, T, card], `mask` [B, dep_q, T]:
    `LMModel.forward(codes)`; Kyutai's NaN (the last `delay` steps of a delayed codebook) kept as NaN;
  - `user_codes` [B, n_q - dep_q, steps]: random user audio codes;
  - the greedy stream: `LMGen(lm, use_sampling=False, **lm_gen_config)` in `lm_gen.streaming(B)`,
    `lm_gen.step(user_codes[:, :, t : t + 1])` for each t:
    - `gen_tokens` [B, 1 + dep_q, steps]: what step t returned ([B, 1 + dep_q, 1]), -1 where it returned None;
    - `step_text` [B, steps], `step_audio` [B, dep_q, steps]: the tokens sampled in step t (`on_text_hook`,
      `on_audio_hook`), before Kyutai re-aligns the delayed codebooks;
    - `step_text_logits` [B, steps, text_card] (`on_text_logits_hook`) and `step_logits` [B, dep_q, steps, card] (the
      depformer's `linears[k]` outputs, by forward hooks);
  - `replay_codes` [B, 1 + n_q, steps]: the stream as teacher-forced codes, such that `LMModel.forward(replay_codes)`
    gives `step_text_logits` at every step and `step_logits[:, k, t + delays[1 + k]]` at [:, k, t] (checked: the
    summary's `replay_*_max_diff`). Column j holds the text of step j, Moshi's codebook k of step j + delays[1 + k],
    and the user codes given at step j + 1 whatever their delay (so `user_codes[:, :, 0]` is never read, see below);
    entries no step produced (the last column's delayed codebooks and user codes) are 0, and no logit depends on them;
- with "pipeline_wav": "<a 16-bit PCM mono 24 kHz WAV>" (a config with a "mimi_config"): `pipeline.npz`, Kyutai's
  offline pipeline over that file for one conversation, from the reloaded folder (`get_mimi`, `get_moshi`), CPU,
  fp32, greedy: the file's n = ceil(samples / frame_size) frames (the last padded with zeros), inside
  `mimi.streaming(1)` and `LMGen(lm, use_sampling=False, **lm_gen_config).streaming(1)`, for each frame t in order
  `codes = mimi.encode(frame)`, `tokens = lm_gen.step(codes)` and, unless None (step 0), `mimi.decode(tokens[:, 1:])`:
  - `frames` [n - 1, 1 + dep_q]: step t's tokens (t = 1 .. n - 1: the text id, then the dep_q audio codes), i.e.
    output frames 1 .. n - 1;
  - `audio` [(n - 1) * frame_size] float32: the streaming decodes of those frames, concatenated;
  - `user_codes` [n_q - dep_q, n]: the streaming encode of the n frames (what `step` was given);
  - `wav` [n * frame_size] float32: the file as read (int16 / 32768, as soundfile reads it) and padded.
  This is the per-frame loop of Kyutai's `moshi.server` (`recv_loop`) and `moshi.run_inference`
  (`InferenceState.run`), less the quirks that "pipeline_variants": [names] (optional) adds, each as
  `<name>_frames`, `<name>_audio` and `<name>_user_codes` (same layout; `run_inference_frames` has n rows):
  - "run_inference": `run_inference` steps the first frame's codes twice (`if first_frame: lm_gen.step(codes)`, None,
    then `lm_gen.step(codes)` again): its step s (1 .. n) is given input frame s - 1, where the plain loop's step s
    is given frame s, so it returns n frames (LMGen's frames 1 .. n), each hearing the input a frame later (here
    over the padded file: `run_inference` itself drops a last partial frame, "We keep only fully frames");
  - "server": `moshi.server` calls `mimi.reset_streaming()` after encoding the first frame ("the first input audio
    frame is ignored"), so frames 1 .. are encoded as if frame 1 were the file's first;
  - "full_window": not Kyutai's behaviour, a diagnosis: the plain pipeline with the Mimi's streaming KV caches one
    slot larger (`RingKVCache` capacity `context + 1`, not `context`). Kyutai's ring cache holds exactly `context`
    keys, so when a streaming call brings T > 1 transformer steps (Mimi's transformers run at twice the code rate:
    T = 2 a frame), writing them evicts keys that the earlier queries of the call may still attend to (its mask
    allows `delta < context`): once a stream is past `context` transformer steps, the first query of each frame
    sees `context - 1` keys, and Kyutai's streaming Mimi drifts from its own offline `encode`/`decode`. With the
    larger cache it equals them (as an implementation that keeps the whole window computes them);
  the summary's "pipeline" says which of those equal the plain pipeline's.
- `summary.json` (also OUT_DIR/summary.json, keyed by name): shapes, special ids, distinct-token counts, LMGen's
  None steps, checks, file names.

LMGen's semantics (moshi 0.2.13, no CFG, no conditioning), max_delay = max(delays) = 1 here: step t feeds the cache
column `t`: the text and Moshi audio sampled at step t - 1 and the user codes given at step t - delay; every stream
whose delay is >= t gets Kyutai's initial token instead (text_card for text, card for audio): so at step 0 all
streams are initial and the user codes given at step 0 are dropped, whatever their delay. step() returns None while
t < max_delay (step 0 only, here), then [B, 1 + dep_q, 1]: the text and codebook-0 tokens sampled at step t - 1 and
the delay-1 codebooks sampled at step t, i.e. one aligned frame, `replay_codes[:, : 1 + dep_q, t - 1]`.

Only this file's functions up to `run_reference` are for the main venv: they import neither torch nor moshi.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOSHI_PYTHON = ROOT / ".venv-moshi" / "bin" / "python"
REFERENCE = Path(__file__).resolve()

MOSHI_NAME = "model.safetensors"
MIMI_NAME = "mimi.safetensors"
MIMI_CONFIG_NAME = "mimi_config.json"
TOKENIZER_NAME = "tokenizer.model"
LM_GEN_CONFIG = {"temp": 0.8, "temp_text": 0.7, "top_k": 250, "top_k_text": 25}
TEXT_SPECIAL_IDS = {"unk": 0, "bos": 1, "eos": 2, "pad": 3}  # Kyutai: 0 ends a text padding, 3 is the padding


def tiny_lm_kwargs(
    dep_q: int = 8,
    *,
    n_q: int | None = None,
    dim: int = 48,
    num_heads: int = 4,
    num_layers: int = 2,
    context: int = 64,
    card: int = 96,
    text_card: int = 128,
    depformer_dim: int = 24,
    depformer_num_heads: int = 2,
    depformer_num_layers: int = 2,
    hidden_scale: float = 4.125,
) -> dict:
    """A tiny LMModel config in the shape of Kyutai's `loaders._lm_kwargs` (Moshi 7B): `n_q = 2 * dep_q` by default
    (Moshi's codebooks then the user's), delays [0 (text), 0, 1 x (dep_q - 1) (Moshi), 0, 1 x (user - 1) (user)].
    `text_card` is the size of the tokenizer that the reference trains; it must stay trainable (about 64 to 400)."""
    n_q = 2 * dep_q if n_q is None else n_q
    user = n_q - dep_q
    return {
        "dim": dim,
        "text_card": text_card,
        "existing_text_padding_id": 3,
        "n_q": n_q,
        "dep_q": dep_q,
        "card": card,
        "num_heads": num_heads,
        "num_layers": num_layers,
        "hidden_scale": hidden_scale,
        "causal": True,
        "layer_scale": None,
        "context": context,
        "max_period": 10000,
        "gating": "silu",
        "norm": "rms_norm_f32",
        "positional_embedding": "rope",
        "depformer_dim": depformer_dim,
        "depformer_dim_feedforward": int(hidden_scale * depformer_dim),
        "depformer_num_heads": depformer_num_heads,
        "depformer_num_layers": depformer_num_layers,
        "depformer_layer_scale": None,
        "depformer_multi_linear": True,
        "depformer_context": dep_q,
        "depformer_max_period": 10000,
        "depformer_gating": "silu",
        "depformer_pos_emb": "none",
        "depformer_weights_per_step": True,
        "delays": [0] + [0] + [1] * (dep_q - 1) + ([0] + [1] * (user - 1) if user else []),
    }


def tiny_mimi_config(n_q: int, bins: int, *, dim: int = 32, ratios: tuple[int, ...] = (4, 4, 2)) -> dict:
    """A tiny Mimi config as `loaders.get_mimi` reads it (Kyutai's `_mimi_config` at other sizes): 32-sample hop,
    750 Hz encoder, 375 Hz codes (a 2x downsampling, as Kyutai's), `n_q` codebooks of `bins`."""
    hop = 1
    for r in ratios:
        hop *= r
    seanet = {
        "channels": 1,
        "dimension": dim,
        "causal": True,
        "n_filters": 4,
        "n_residual_layers": 1,
        "activation": "ELU",
        "compress": 2,
        "dilation_base": 2,
        "disable_norm_outer_blocks": 0,
        "kernel_size": 7,
        "residual_kernel_size": 3,
        "last_kernel_size": 3,
        "norm": "none",
        "pad_mode": "constant",
        "ratios": list(ratios),
        "true_skip": True,
    }
    transformer = {
        "d_model": dim,
        "num_heads": 4,
        "num_layers": 1,
        "causal": True,
        "layer_scale": 0.01,
        "context": 16,
        "conv_layout": True,
        "max_period": 10000,
        "gating": "none",
        "norm": "layer_norm",
        "positional_embedding": "rope",
        "dim_feedforward": 2 * dim,
        "input_dimension": dim,
        "output_dimensions": [dim],
    }
    quantizer = {"dimension": 16, "n_q": n_q, "bins": bins, "input_dimension": dim, "output_dimension": dim}
    return {
        "sample_rate": 24000,
        "channels": 1,
        "frame_rate": 24000 / hop / 2,
        "seanet": seanet,
        "quantizer": quantizer,
        "transformer": transformer,
    }


def run_reference(spec: dict, out_dir: Path, timeout: float = 300) -> None:
    """Writes `out_dir/spec.json` and runs this script on it with .venv-moshi's Python; raises with its stderr."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [str(MOSHI_PYTHON), str(REFERENCE), str(out_dir / "spec.json"), str(out_dir)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"tests/moshi_reference.py failed ({proc.returncode}):\n{proc.stderr[-6000:]}")


# ---- from here on, .venv-moshi only (torch, moshi, sentencepiece) ----


def sentences(count: int, seed: int) -> list[str]:
    """Seeded short English sentences from a small grammar, to train the tokenizer on."""
    import random

    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the teacher", "our team", "she", "he", "they", "we", "you", "I"]
    subjects += ["the old man", "a little girl", "the robot", "his brother", "the pilot", "her mother"]
    verbs = ["sees", "likes", "wants", "finds", "takes", "makes", "needs", "brings", "reads", "builds", "paints"]
    verbs += ["opens", "closes", "buys", "sells", "watches", "hears", "loves", "carries", "writes", "cleans"]
    objects = ["a red ball", "the blue door", "some water", "a new book", "the garden", "two apples", "the music"]
    objects += ["a small boat", "the window", "three letters", "a warm coat", "the old car", "fresh bread", "a song"]
    tails = ["today", "every morning", "at night", "in the park", "near the river", "with a smile", "very slowly"]
    tails += ["after lunch", "before dinner", "on sunday", "quickly", "again", "at home", "in the city", "together"]
    questions = ["how are you", "what time is it", "where is the station", "can you help me", "do you like tea"]
    questions += ["why not", "who is there", "is it raining", "what is your name", "shall we go"]
    out = []
    for i in range(count):
        if i % 5 == 4:
            s = rng.choice(questions) + "?"
        else:
            s = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}."
            if rng.random() < 0.2:
                s = s[:-1] + f", {rng.randint(1, 99)} times."
        out.append(s[0].upper() + s[1:])
    return out


def train_tokenizer(path: Path, vocab_size: int, seed: int) -> None:
    """A sentencepiece unigram model of exactly `vocab_size` pieces, ids 0-3 as `TEXT_SPECIAL_IDS`."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences(400, seed)),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        hard_vocab_limit=True,
        unk_id=TEXT_SPECIAL_IDS["unk"],
        bos_id=TEXT_SPECIAL_IDS["bos"],
        eos_id=TEXT_SPECIAL_IDS["eos"],
        pad_id=TEXT_SPECIAL_IDS["pad"],
        num_threads=1,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert sp.get_piece_size() == vocab_size, (sp.get_piece_size(), vocab_size)
    assert [sp.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]


def checkpoint_info(folder: Path):
    """Kyutai's `CheckpointInfo` of a local checkpoint folder (config.json and the files it names)."""
    from moshi.models import loaders

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    mimi_config = raw.get("mimi_config_name")
    return loaders.CheckpointInfo.from_hf_repo(
        "local/unused",  # never read: every file is given
        moshi_weights=folder / raw.get("moshi_name", MOSHI_NAME),
        mimi_weights=folder / raw.get("mimi_name", MIMI_NAME),
        tokenizer=folder / raw.get("tokenizer_name", TOKENIZER_NAME),
        config_path=folder / "config.json",
        mimi_config_path=None if mimi_config is None else folder / mimi_config,
    )


def randomize(lm, seed: int) -> None:
    """Every weight tensor but the norms' times a seeded factor in [1.5, 2.5]. Kyutai's init alone already gives
    varied greedy tokens, but logits with a std of about 1 (text) and 0.65 (audio), whose near-ties a port's fp32
    rounding could flip; scaled, about 2 and 5 (the summary's `*_std` and `min_step_*_margin`)."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "norm" in name:
                continue  # RMS norm's alpha: scaling it would only scale the next linear
            p.mul_(1.5 + torch.rand((), generator=g))


def run_config(spec: dict, out: Path) -> dict:
    import numpy as np
    import torch
    from moshi.models import loaders
    from moshi.models.lm import LMGen, LMModel
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    seed, lm_kwargs = int(spec["seed"]), dict(spec["lm"])
    lm_gen_config = dict(spec.get("lm_gen_config", LM_GEN_CONFIG))
    B, steps = int(spec["batch"]), int(spec["steps"])
    T = int(spec.get("frames", steps))
    n_q, dep_q, card, text_card = lm_kwargs["n_q"], lm_kwargs["dep_q"], lm_kwargs["card"], lm_kwargs["text_card"]
    delays = list(lm_kwargs["delays"])
    n_user = n_q - dep_q

    # ---- the checkpoint folder
    torch.manual_seed(seed)
    lm = LMModel(device="cpu", dtype=torch.float32, **lm_kwargs)
    randomize(lm, seed)
    lm.eval()
    save_file({k: v.contiguous() for k, v in lm.state_dict().items()}, str(out / MOSHI_NAME))
    train_tokenizer(out / TOKENIZER_NAME, text_card, seed)
    config = dict(lm_kwargs, moshi_name=MOSHI_NAME, tokenizer_name=TOKENIZER_NAME, lm_gen_config=lm_gen_config)
    files = ["config.json", MOSHI_NAME, TOKENIZER_NAME]
    mimi_summary = None
    if spec.get("mimi_config") is not None:
        from mimi_reference import randomize as randomize_mimi
        from mimi_reference import signals

        mimi_cfg = spec["mimi_config"]
        k_mimi = max(dep_q, n_user)
        assert mimi_cfg["quantizer"]["bins"] == card, (mimi_cfg["quantizer"]["bins"], card)
        assert mimi_cfg["quantizer"]["n_q"] >= k_mimi, (mimi_cfg["quantizer"]["n_q"], k_mimi)
        torch.manual_seed(seed + 3)
        mimi = loaders.get_mimi(None, mimi_cfg, device="cpu", num_codebooks=k_mimi)
        wav = torch.from_numpy(signals(2, 8 * mimi.frame_size, seed))
        randomize_mimi(mimi, wav, seed)
        save_file({k: v.contiguous() for k, v in mimi.state_dict().items()}, str(out / MIMI_NAME))
        (out / MIMI_CONFIG_NAME).write_text(json.dumps(mimi_cfg, indent=1))
        config.update(mimi_name=MIMI_NAME, mimi_config_name=MIMI_CONFIG_NAME)
        files += [MIMI_NAME, MIMI_CONFIG_NAME]
    (out / "config.json").write_text(json.dumps(config, indent=1))

    # ---- every output from the folder, as a user of Kyutai's package loads it
    info = checkpoint_info(out)
    assert info.lm_gen_config == lm_gen_config and info.lm_config == lm_kwargs
    model = info.get_moshi(device="cpu", dtype=torch.float32)
    assert model.dtype == torch.float32
    text_tokenizer = info.get_text_tokenizer()
    assert text_tokenizer.get_piece_size() == text_card
    if spec.get("mimi_config") is not None:
        mimi = info.get_mimi(device="cpu")
        assert mimi.cardinality == card and mimi.num_codebooks == max(dep_q, n_user)
        mimi_codes = mimi.encode(wav[:, None])
        mimi_summary = {
            "frame_size": mimi.frame_size,
            "frame_rate": mimi.frame_rate,
            "num_codebooks": mimi.num_codebooks,
            "distinct_codes": int(mimi_codes.unique().numel()),
        }

    g = torch.Generator().manual_seed(seed + 2)
    codes = torch.cat(
        [torch.randint(0, text_card, (B, 1, T), generator=g), torch.randint(0, card, (B, n_q, T), generator=g)], 1
    )
    user_codes = torch.randint(0, card, (B, n_user, steps), generator=g)
    with torch.no_grad():
        fwd = model.forward(codes)
        fwd_orig = lm.forward(codes)
    reload_diff = max(
        float((a - b).abs().nan_to_num(0).max())
        for a, b in ((fwd.logits, fwd_orig.logits), (fwd.text_logits, fwd_orig.text_logits))
    )
    assert torch.equal(fwd.logits.isnan(), fwd_orig.logits.isnan())

    # ---- the greedy stream
    step_text, step_audio, step_text_logits = [], [], []
    step_logits: list[list[torch.Tensor]] = []
    lm_gen = LMGen(
        model,
        use_sampling=False,
        **lm_gen_config,
        on_text_hook=lambda t: step_text.append(t.clone()),
        on_audio_hook=lambda a: step_audio.append(a.clone()),
        on_text_logits_hook=lambda x: step_text_logits.append(x[:, 0, 0].float().clone()),
    )

    def linear_hook(k: int):
        def hook(_module, _inputs, output):
            if k == 0:
                step_logits.append([])
            step_logits[-1].append(output[:, 0].float().clone())  # [B, 1, card] -> [B, card]

        return hook

    handles = [lin.register_forward_hook(linear_hook(k)) for k, lin in enumerate(model.linears)]
    gen_tokens = torch.full((B, 1 + dep_q, steps), -1, dtype=torch.long)
    none_steps = []
    with lm_gen.streaming(B):
        for t in range(steps):
            got = lm_gen.step(user_codes[:, :, t : t + 1])
            assert len(step_text) == len(step_audio) == len(step_text_logits) == len(step_logits) == t + 1
            if got is None:
                none_steps.append(t)
            else:
                assert got.shape == (B, 1 + dep_q, 1), got.shape
                gen_tokens[:, :, t] = got[:, :, 0]
    for h in handles:
        h.remove()
    step_text_t = torch.stack(step_text, 1)  # [B, steps]
    step_audio_t = torch.stack(step_audio, 2)  # [B, dep_q, steps]
    step_text_logits_t = torch.stack(step_text_logits, 1)  # [B, steps, text_card]
    step_logits_t = torch.stack([torch.stack(s, 1) for s in step_logits], 2)  # [B, dep_q, steps, card]
    assert torch.equal(step_text_t, step_text_logits_t.argmax(-1))
    assert torch.equal(step_audio_t, step_logits_t.argmax(-1))

    # ---- the stream replayed as teacher-forced codes (the module docstring)
    replay = torch.zeros((B, 1 + n_q, steps), dtype=torch.long)
    replay[:, 0] = step_text_t
    for k in range(dep_q):
        d = delays[1 + k]
        replay[:, 1 + k, : steps - d] = step_audio_t[:, k, d:]
    replay[:, 1 + dep_q :, : steps - 1] = user_codes[:, :, 1:]
    with torch.no_grad():
        rf = model.forward(replay)
    replay_text_diff = float((rf.text_logits[:, 0] - step_text_logits_t).abs().max())
    replay_audio_diff = 0.0
    for k in range(dep_q):
        d = delays[1 + k]
        diff = (rf.logits[:, k, : steps - d] - step_logits_t[:, k, d:]).abs().max()
        replay_audio_diff = max(replay_audio_diff, float(diff))
    first = none_steps[-1] + 1 if none_steps else 0
    if first:
        assert torch.equal(gen_tokens[:, :, first:], replay[:, : 1 + dep_q, first - 1 : steps - 1])

    def min_margin(x: torch.Tensor) -> float:
        top2 = x.topk(2, dim=-1).values
        return float((top2[..., 0] - top2[..., 1]).min())

    arrays = {
        "codes": codes,
        "text_logits": fwd.text_logits.float(),
        "text_mask": fwd.text_mask,
        "logits": fwd.logits.float(),
        "mask": fwd.mask,
        "user_codes": user_codes,
        "gen_tokens": gen_tokens,
        "step_text": step_text_t,
        "step_audio": step_audio_t,
        "step_text_logits": step_text_logits_t,
        "step_logits": step_logits_t,
        "replay_codes": replay,
    }
    np.savez(out / "ref.npz", **{k: v.numpy() for k, v in arrays.items()})
    greedy_text = fwd.text_logits[:, 0].argmax(-1)
    summary = {
        "checkpoint_dir": str(out),
        "files": files,
        "ref": "ref.npz",
        "shapes": {k: list(v.shape) for k, v in arrays.items()},
        "lm_gen_config": lm_gen_config,
        "delays": delays,
        "max_delay": lm_gen.max_delay,
        "ids": {
            "text_initial_token_id": model.text_initial_token_id,
            "initial_token_id": model.initial_token_id,
            "text_padding_token_id": model.text_padding_token_id,
            "end_of_text_padding_id": model.end_of_text_padding_id,
            "zero_token_id": model.zero_token_id,
            "ungenerated_token_id": model.ungenerated_token_id,
            "tokenizer_pieces_0_3": [text_tokenizer.id_to_piece(i) for i in range(4)],
            "tokenizer_size": text_tokenizer.get_piece_size(),
        },
        "none_steps": none_steps,
        "first_output_step": first,
        "distinct_step_text": int(step_text_t.unique().numel()),
        "distinct_step_audio": int(step_audio_t.unique().numel()),
        "distinct_step_audio_per_codebook": [int(step_audio_t[:, k].unique().numel()) for k in range(dep_q)],
        "distinct_forward_greedy_text": int(greedy_text.unique().numel()),
        "text_logits_std": float(fwd.text_logits.std()),
        "logits_std": float(fwd.logits.nan_to_num(0).std()),
        "min_step_text_margin": min_margin(step_text_logits_t),
        "min_step_audio_margin": min_margin(step_logits_t),
        "reload_max_diff": reload_diff,
        "replay_text_max_diff": replay_text_diff,
        "replay_audio_max_diff": replay_audio_diff,
        "mimi": mimi_summary,
    }
    if spec.get("pipeline_wav") is not None:
        assert spec.get("mimi_config") is not None, "pipeline_wav needs a mimi_config"
        variants = list(spec.get("pipeline_variants", []))
        summary["pipeline"] = run_pipeline(info, Path(spec["pipeline_wav"]), variants, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def read_wav(path: Path):
    """A 16-bit PCM mono 24 kHz WAV as float32 samples, int16 / 32768 (as soundfile reads it; the stdlib `wave`:
    .venv-moshi has no soundfile)."""
    import wave

    import numpy as np

    with wave.open(str(path), "rb") as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2 and w.getframerate() == 24000, (
            path,
            w.getnchannels(),
            w.getsampwidth(),
            w.getframerate(),
        )
        data = w.readframes(w.getnframes())
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768


def pipeline(info, wav, variant: str | None = None):
    """Kyutai's offline pipeline (the module docstring's `pipeline.npz`) over `wav` [n * frame_size], one
    conversation, a freshly loaded Mimi and LM: (frames [F, 1 + dep_q], audio [F * frame_size], user codes
    [n_q - dep_q, n]); `variant`: one of the docstring's "pipeline_variants", or None."""
    import contextlib

    import torch
    from moshi.models.lm import LMGen
    from moshi.modules import transformer

    assert variant in (None, "run_inference", "server", "full_window"), variant
    mimi = info.get_mimi(device="cpu")
    lm = info.get_moshi(device="cpu", dtype=torch.float32)
    n_user = lm.num_codebooks - 1 - lm.dep_q
    lm_gen = LMGen(lm, use_sampling=False, **info.lm_gen_config)
    fs = mimi.frame_size
    assert len(wav) % fs == 0
    frames, audio, user = [], [], []
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        if variant == "full_window":  # (the Mimi's caches are made as its streaming starts, the LM's after)
            init = transformer.RingKVCache.__init__

            def larger(self, batch_size, num_heads, dim_per_head, capacity, *args, **kwargs):
                init(self, batch_size, num_heads, dim_per_head, capacity + 1, *args, **kwargs)

            transformer.RingKVCache.__init__ = larger
            try:
                stack.enter_context(mimi.streaming(1))
            finally:
                transformer.RingKVCache.__init__ = init
        else:
            stack.enter_context(mimi.streaming(1))
        stack.enter_context(lm_gen.streaming(1))
        for t in range(len(wav) // fs):
            chunk = torch.from_numpy(wav[t * fs : (t + 1) * fs].copy())[None, None]
            codes = mimi.encode(chunk)  # [1, K, 1]
            assert codes.shape == (1, mimi.num_codebooks, 1), codes.shape
            user.append(codes[0, :n_user, 0])
            if t == 0 and variant == "server":
                mimi.reset_streaming()
            if t == 0 and variant == "run_inference":
                assert lm_gen.step(codes) is None
            tokens = lm_gen.step(codes)
            if tokens is None:
                assert t == 0 and variant != "run_inference"
                continue
            assert tokens.shape == (1, 1 + lm.dep_q, 1), tokens.shape
            pcm = mimi.decode(tokens[:, 1:])  # [1, 1, frame_size]
            assert pcm.shape == (1, 1, fs), pcm.shape
            frames.append(tokens[0, :, 0])
            audio.append(pcm[0, 0])
    return torch.stack(frames).numpy(), torch.cat(audio).numpy(), torch.stack(user, 1).numpy()


def run_pipeline(info, wav_path: Path, variants: list[str], out: Path) -> dict:
    """`pipeline.npz` (the module docstring) and its summary."""
    import numpy as np

    raw = read_wav(wav_path)
    fs = info.get_mimi(device="cpu").frame_size
    n = -(-len(raw) // fs)
    wav = np.pad(raw, (0, n * fs - len(raw)))
    frames, audio, user_codes = pipeline(info, wav)
    arrays = {"frames": frames, "audio": audio, "user_codes": user_codes, "wav": wav}
    summary = {
        "wav": str(wav_path),
        "samples": len(raw),
        "frame_size": fs,
        "input_frames": n,
        "audio_max_abs": float(np.abs(audio).max()),
        "distinct_text": int(np.unique(frames[:, 0]).size),
        "distinct_codes": int(np.unique(frames[:, 1:]).size),
        "variants": {},
    }
    for name in variants:
        v_frames, v_audio, v_user = pipeline(info, wav, name)
        arrays.update({f"{name}_frames": v_frames, f"{name}_audio": v_audio, f"{name}_user_codes": v_user})
        same_steps = v_frames[: len(frames)]  # (LMGen's frames 1 .. n - 1: run_inference has one more)
        summary["variants"][name] = {
            "frames_differing": [1 + int(f) for f in np.flatnonzero((same_steps != frames).any(1))],
            "user_code_frames_differing": [int(f) for f in np.flatnonzero((v_user != user_codes).any(0))],
            "audio_max_diff": float(np.abs(v_audio[: len(audio)] - audio).max()),
        }
    np.savez(out / "pipeline.npz", **arrays)
    summary["shapes"] = {k: list(v.shape) for k, v in arrays.items()}
    return summary


def main() -> None:
    import torch

    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    spec = json.loads(spec_path.read_text())
    summary = {c["name"]: run_config(c, out_dir / c["name"]) for c in spec["configs"]}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
