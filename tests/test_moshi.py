"""Moshi's family served: tiny random checkpoints written by Kyutai's own code (`tests/moshi_reference.py`, run in
.venv-moshi), loaded by `s2s.models.family.load_model`, compared with Kyutai's `LMModel.forward` (teacher forcing) and
`LMGen.step` (streaming greedy, through the engine)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from moshi_reference import MOSHI_PYTHON, run_reference, tiny_lm_kwargs, tiny_mimi_config
from safetensors.torch import load_file, save_file

from codec import MimiTokenizer
from s2s import PagedBatch, SamplingParams
from s2s.engine.engine import CodesEvent, Engine, EngineConfig
from s2s.models.family import load_model
from s2s.models.moshi.config import MoshiConfig
from s2s.models.moshi.head_graphs import HeadGraphs
from s2s.models.moshi.model import MoshiLM
from s2s.models.moshi.persona import persona_prompt
from s2s.runner.batch import page_table
from s2s.runner.cuda_graphs import DecodeGraphs

GREEDY = SamplingParams(temperature=0)
CONFIGS = {"dep8": 8, "dep16": 16}
STEPS = 40  # past two pages of 16 beyond the 16-step window: where a sink would leak in


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    if not MOSHI_PYTHON.exists():
        pytest.skip(f"Kyutai's moshi needs {MOSHI_PYTHON} (scripts/setup_moshi_client.sh)")
    out = tmp_path_factory.mktemp("moshi")
    configs = [
        {"name": name, "seed": dep_q, "lm": tiny_lm_kwargs(dep_q, context=16), "batch": 4, "steps": STEPS, "frames": 20}
        for name, dep_q in CONFIGS.items()
    ]  # (a window of 16 steps: the streaming test crosses it)
    configs.append({"name": "long", "seed": 1, "lm": tiny_lm_kwargs(8, context=256), "batch": 1, "steps": 4})
    run_reference({"configs": configs}, out)
    return out


def load(folder: Path) -> MoshiLM:
    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    assert isinstance(model, MoshiLM)
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_teacher_forced_logits_equal_kyutais(reference, name) -> None:
    folder = reference / name
    ref = np.load(folder / "ref.npz")
    model = load(folder)
    with torch.no_grad():
        text, audio = model(torch.from_numpy(ref["codes"]))
    theirs_text, theirs_audio = torch.from_numpy(ref["text_logits"][:, 0]), torch.from_numpy(ref["logits"])
    assert torch.equal(text.isnan(), theirs_text.isnan()) and torch.equal(audio.isnan(), theirs_audio.isnan())
    for ours, theirs in ((text, theirs_text), (audio, theirs_audio)):  # 1e-4 of the logits' scale (about 10 here)
        scale = max(1.0, float(theirs.nan_to_num().abs().max()))
        assert (ours - theirs).nan_to_num().abs().max() <= 1e-4 * scale
    assert audio.shape[1] == CONFIGS[name]  # every depformer codebook


def stream(engine: Engine, user: np.ndarray, steps: int) -> list[np.ndarray]:
    """Open a greedy duplex conversation per row of `user` `[B, K', steps]`, push each its codes, tick until every
    one has computed `steps` steps; each one's model frames `[K, steps - 1]` from frame 1 on, as its events carry
    them (frames out of the window are forgotten by the session)."""
    cids = [engine.open("duplex", sampling=GREEDY) for _ in user]
    for cid, codes in zip(cids, user, strict=True):
        engine.push_codes(cid, codes)
    frames: dict[str, dict[int, np.ndarray]] = {c: {} for c in cids}
    for _ in range(10 * steps):
        engine.step()
        for c in cids:
            q = engine.event_queue(c)
            while not q.empty():
                if isinstance(event := q.get_nowait(), CodesEvent):
                    frames[c].update({event.first_frame + i: event.codes[:, i] for i in range(event.codes.shape[1])})
        if all(engine.sessions[c].computed >= steps for c in cids):
            break
    return [np.stack([frames[c][f] for f in range(1, steps)], axis=1) for c in cids]


@pytest.mark.parametrize("mode", ["naive", "radix"])
def test_streaming_greedy_through_the_engine_equals_lmgen(reference, mode) -> None:
    """Kyutai's LMGen returns, at step t >= 1, frame t of Moshi's streams (text, audio): the engine's model frame t.
    Alone, and four conversations at once (the reference's batch of 4), in both cache modes, batch-invariant."""
    ref = np.load(reference / "dep8" / "ref.npz")
    model = load(reference / "dep8")
    config = dict(max_context=256, num_pages=400, cache_mode=mode, deterministic=True, calibration_ticks=0)
    expected = ref["gen_tokens"][:, :, 1:]
    alone = stream(Engine(model, None, EngineConfig(**config)), ref["user_codes"][:1], STEPS)
    together = stream(Engine(model, None, EngineConfig(**config)), ref["user_codes"], STEPS)
    np.testing.assert_array_equal(alone[0], expected[0])
    for b, frames in enumerate(together):
        np.testing.assert_array_equal(frames, expected[b], err_msg=f"conversation {b}")
    assert len(np.unique(expected[:, 0])) > 3  # the text varies: the comparison can fail


def test_bad_checkpoints_are_named(reference, tmp_path) -> None:
    source = reference / "dep8"

    def copy(name: str) -> Path:
        folder = tmp_path / name
        shutil.copytree(source, folder)
        return folder

    folder = copy("missing")
    state = load_file(folder / "model.safetensors")
    del state["linears.3.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors.*linears.3.weight is missing"):
        load(folder)

    folder = copy("shape")
    state = load_file(folder / "model.safetensors")
    state["text_linear.weight"] = state["text_linear.weight"][:-1]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors.*text_linear.weight has shape"):
        load(folder)

    folder = copy("model_type")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "tts"}))
    with pytest.raises(ValueError, match=r"config.json.*model_type 'tts'"):
        load(folder)

    folder = copy("tokenizer")
    config = json.loads((folder / "config.json").read_text())
    config["text_card"] += 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tokenizer.model.*pieces but the model's text_card is"):
        load(folder)


def random_moshi(dep_q: int = 4, seed: int = 0) -> MoshiLM:
    kwargs = tiny_lm_kwargs(dep_q, context=16)
    model = MoshiLM(MoshiConfig.from_kyutai(kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def step_tokens(model: MoshiLM, n: int, rng: np.random.Generator) -> np.ndarray:
    """Valid step tokens: the user's empty text slot, then audio; the model's text, then audio."""
    cfg, moshi = model.config, model.moshi
    k = cfg.num_codebooks
    tokens = rng.integers(0, moshi.card, (n, 2 * k))
    tokens[:, 0] = cfg.pad_id
    tokens[:, k] = rng.integers(0, moshi.text_card, n)
    return tokens


@pytest.mark.parametrize("n", [1, 3])
def test_decode_graphs_hold_moshi_s_round(n) -> None:
    """The CUDA graphs' round (here its eager twin: the same static buffers and padding) through the model
    interface gives what the eager paged forward gives: Moshi's temporal outputs and K/V."""
    model, page = random_moshi(), 4
    cfg, rng = model.config, np.random.default_rng(n)
    shape = (40, page, cfg.num_key_value_heads, cfg.head_dim)
    k = [torch.randn(shape) for _ in range(cfg.num_hidden_layers)]
    v = [torch.randn(shape) for _ in range(cfg.num_hidden_layers)]
    k_ref, v_ref = [t.clone() for t in k], [t.clone() for t in v]
    graphs = DecodeGraphs(model, k, v, page, max_batch=8, max_pages=6, capture=False)
    cached = [int(c) for c in rng.integers(0, 20, n)]
    perm = rng.permutation(np.arange(1, 40))
    pages = [[int(p) for p in perm[6 * s : 6 * s + c // page + 1]] for s, c in enumerate(cached)]
    tokens = step_tokens(model, n, rng)
    got = graphs.run(tokens, np.array(cached), page_table(pages), np.array([len(p) for p in pages]))
    batch = PagedBatch.build(cached, [1] * n, pages, page)
    want = model.forward_paged(torch.from_numpy(tokens), batch, k_ref, v_ref).state
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for layer in range(cfg.num_hidden_layers):
        torch.testing.assert_close(k[layer], k_ref[layer])
        torch.testing.assert_close(v[layer], v_ref[layer])


def test_the_head_samples_each_row_as_it_would_alone() -> None:
    """The depformer batched across rows: each row's codes, greedy or sampled, are those it gets alone (its own
    state, settings and stream; what else is in the batch changes nothing), and lie in their vocabularies."""
    model = random_moshi()
    state = torch.randn(5, model.moshi.dim, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0, 0.8, 0.8, 1.2, 0])]
    batched = model.head(state, params, [p.generator() for p in params])
    for i, p in enumerate(params):
        alone = model.head(state[i : i + 1], [p], [p.generator()])
        assert torch.equal(alone[0], batched[i])
    assert batched.shape == (5, 1 + model.moshi.dep_q)
    assert (batched[:, 0] < model.moshi.text_card).all() and (batched[:, 1:] < model.moshi.card).all()


def test_a_shared_persona_prompt_is_computed_once(reference) -> None:
    """PersonaPlex's persona (a voice, then a role text) ahead of four conversations opened at once: in radix mode
    the first computes it and the others get its whole pages back from the cache; paged mode computes it four
    times. The prompt's frames are both streams': the model's text and audio, the user's sine."""
    model = load(reference / "long")  # a window longer than the prompt, as Moshi's 3,000 steps are
    lm = tiny_lm_kwargs(8, context=256)
    tok = MimiTokenizer.random(tiny_mimi_config(8, lm["card"]), seed=0, num_codebooks=8)
    voice = (0.3 * np.random.default_rng(0).standard_normal(40 * tok.frame_size)).clip(-1, 1).astype(np.float32)
    prompt = persona_prompt(model.config, tok, model.text_pieces, voice, "you are a helpful gardener")
    text_ids = model.text_pieces.processor.encode("<system> you are a helpful gardener <system>")
    assert prompt.frames == 40 + 1 + len(text_ids) + 1 and (prompt.user[0] == model.config.pad_id).all()
    assert list(prompt.model[0, 41 : 41 + len(text_ids)]) == text_ids
    computed, hits = {}, {}
    for mode in ("paged", "radix"):
        config = EngineConfig(max_context=256, num_pages=400, cache_mode=mode, calibration_ticks=0, prefill_budget=32)
        engine = Engine(model, tok, config)
        engine.add_voice("gardener", prompt)
        cids = [engine.open("duplex", prompt="gardener", sampling=GREEDY, admit=False) for _ in range(4)]
        for _ in range(40):
            engine.step()
        assert all(engine.sessions[c].computed >= prompt.frames - 1 for c in cids)
        computed[mode], hits[mode] = engine.stats.prefill_steps, engine.cache.stats().hit_steps
        engine.cache.check()
    page = EngineConfig().page_size
    shared = (prompt.frames - 1) // page * page  # whole pages of the prompt (a match never covers a key's last step)
    assert computed["paged"] >= 4 * (prompt.frames - 1) and hits["paged"] == 0
    assert hits["radix"] == 3 * shared and computed["radix"] <= computed["paged"] - 3 * shared


def test_the_head_s_graphs_choose_what_the_head_chooses() -> None:
    """HeadGraphs (here their eager twin: the same static buffers, padding and fixed ops) give each row what
    `MoshiLM.head` gives it, greedy and sampled, at batch sizes that fill and pad a bucket."""
    model = random_moshi()
    graphs = HeadGraphs(model, max_batch=8, device="cpu", capture=False)
    for n in (1, 3, 8):
        state = torch.randn(n, model.moshi.dim, generator=torch.Generator().manual_seed(n))
        params = [SamplingParams(temperature=[0, 0.8, 1.1][i % 3], top_k=[250, 5, 0][i % 3], seed=i) for i in range(n)]
        want = model.head(state, params, [p.generator() for p in params])
        got = graphs.run(state, params, [p.generator() for p in params])
        assert torch.equal(got, want), n


def test_a_layout_the_engine_cannot_step_is_refused() -> None:
    """The engine's steps hold as many user audio codebooks as generated ones, with the same delays."""
    with pytest.raises(ValueError, match="8 generated audio codebooks but 0 of the user's"):
        MoshiConfig.from_kyutai(tiny_lm_kwargs(8, n_q=8), where="config.json")
    kwargs = tiny_lm_kwargs(4)
    kwargs["delays"] = [0, 0, 1, 1, 1, 0, 2, 2, 2]
    with pytest.raises(ValueError, match="audio delays .* differ"):
        MoshiConfig.from_kyutai(kwargs, where="config.json")
