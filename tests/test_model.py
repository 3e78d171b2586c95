"""s2s/ model: backbone equals transformers' LlamaModel, the paged forward equals the no-cache reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from s2s import ModelConfig, PagedBatch, S2SModel, SamplingParams, sample
from s2s.runner.batch import page_table
from s2s.runner.sampling import RandomStream, _top_k, _top_k_top_p


class Pages:
    """A minimal page table for tests: one K/V tensor per layer and a free list (cache/ does the real thing)."""

    def __init__(self, cfg: ModelConfig, page_size: int, num_pages: int = 512):
        shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [torch.full(shape, 1e4) for _ in range(cfg.num_hidden_layers)]  # unwritten = poison
        self.v = [torch.full(shape, 1e4) for _ in range(cfg.num_hidden_layers)]
        self.page_size = page_size
        self.free = list(range(num_pages - 1, 0, -1))
        self.tables: dict[int, list[int]] = {}

    def grow(self, seq: int, steps: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.page_size < steps:
            table.append(self.free.pop())
        return table

    def step(self, model: S2SModel, seqs: list[tuple[int, torch.Tensor, int]], batch_invariant: bool = False):
        """seqs: (seq id, new tokens [n, 2K], cached steps). Runs one batched paged forward."""
        tables = [self.grow(s, cached + len(t)) for s, t, cached in seqs]
        batch = PagedBatch.build([c for _, _, c in seqs], [len(t) for _, t, _ in seqs], tables, self.page_size)
        tokens = torch.cat([t for _, t, _ in seqs])
        return model.forward_paged(tokens, batch, self.k, self.v, batch_invariant), batch

    def kv(self, seq: int, steps: int) -> torch.Tensor:
        """The K and V a sequence's first `steps` steps stored: `[2, layers, steps, kv_heads, head_dim]`."""
        table = self.tables[seq]
        return torch.stack(
            [torch.stack([c[table].flatten(0, 1)[:steps] for c in caches]) for caches in (self.k, self.v)]
        )


def random_tokens(cfg: ModelConfig, steps: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (steps, cfg.step_width), generator=g)


@pytest.fixture(scope="module")
def tiny() -> S2SModel:
    return S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0)


# ---- config and backbone ------------------------------------------------------------------------------------------


def test_presets_and_config_round_trip(tmp_path) -> None:
    sizes = {}
    for name in ("tiny", "small", "base", "large"):
        cfg = ModelConfig.preset(name, num_codebooks=8)
        with torch.device("meta"):
            sizes[name] = sum(p.numel() for p in S2SModel(cfg).parameters())
    assert sizes["tiny"] < sizes["small"] < 20e6
    assert 70e6 < sizes["base"] < 150e6 and 0.7e9 < sizes["large"] < 1.5e9
    cfg = ModelConfig.preset("small", num_codebooks=4, sliding_window=128)
    cfg.save(tmp_path)
    assert ModelConfig.load(tmp_path) == cfg
    assert cfg.delays == [0, 1, 2, 3] and cfg.step_width == 8
    for bad in (dict(delays=[0, 1, 2]), dict(num_key_value_heads=3), dict(sliding_window=0)):
        with pytest.raises(ValueError, match="bad ModelConfig"):
            ModelConfig.preset("tiny", **bad)
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.preset("huge")


@pytest.mark.parametrize("kv_heads", [2, 4, 1])
def test_backbone_equals_transformers_llama(kv_heads: int) -> None:
    cfg = ModelConfig.preset("tiny", num_key_value_heads=kv_heads)
    model = S2SModel.from_seed(cfg, seed=1)
    ref = LlamaModel(cfg.to_llama_config()).eval()
    missing, unexpected = ref.load_state_dict(model.backbone.state_dict(), strict=False)
    assert missing == ["embed_tokens.weight"] and unexpected == []
    x = torch.randn(3, 29, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(inputs_embeds=x).last_hidden_state
    assert (model.backbone(x) - want).abs().max() <= 1e-4


# ---- paged forward ------------------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=4),
    page_size=st.sampled_from([1, 16, 5]),
    window=st.sampled_from([None, 7]),
    seed=st.integers(0, 100),
)
def test_paged_forward_equals_reference(lengths, page_size, window, seed) -> None:
    """Each sequence: a prompt prefilled in one extend, then a mix of decode and extend chunks, all batched."""
    cfg = ModelConfig.preset("tiny", sliding_window=window)
    model = S2SModel.from_seed(cfg, seed=0)
    seqs = [random_tokens(cfg, a + b, seed + i) for i, (a, b) in enumerate(lengths)]
    ref = [model(t[None])[0] for t in seqs]
    pages = Pages(cfg, page_size)
    pos = [0] * len(seqs)
    prompt = [a for a, _ in lengths]
    rng = torch.Generator().manual_seed(seed)
    while any(p < len(t) for p, t in zip(pos, seqs, strict=True)):
        todo = []
        for s, t in enumerate(seqs):
            if pos[s] < len(t):
                n = prompt[s] if pos[s] == 0 else int(torch.randint(1, 4, (1,), generator=rng))
                todo.append((s, t[pos[s] : pos[s] + n], pos[s]))
        out, _ = pages.step(model, todo)
        for j, (s, toks, cached) in enumerate(todo):
            pos[s] = cached + len(toks)
            assert (out.state[j] - ref[s][pos[s] - 1]).abs().max() <= 1e-4, (s, pos[s])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=6), min_size=1, max_size=8), st.integers(0, 3))
def test_page_table_pads_each_list_with_zeros(pages: list[list[int]], extra_rows: int) -> None:
    table = page_table(pages, len(pages) + extra_rows)
    width = max(map(len, pages))
    assert table.dtype.name == "int32" and table.shape == (len(pages) + extra_rows, width)
    assert table.tolist() == [p + [0] * (width - len(p)) for p in pages] + [[0] * width] * extra_rows
    with pytest.raises(ValueError, match="do not fit"):
        page_table(pages, len(pages) - 1)


def test_sliding_window_never_reads_pages_behind_it() -> None:
    """A page whose steps have all left the window is never read again: given to someone else (poisoned) and its
    table entry pointed at the padding page, the output does not change, so the sequence lives in a few pages."""
    cfg = ModelConfig.preset("tiny", sliding_window=8)
    model = S2SModel.from_seed(cfg, seed=0)
    toks = random_tokens(cfg, 60, seed=3)
    ref = model(toks[None])[0]
    page_size = 4
    pages = Pages(cfg, page_size, num_pages=8)  # 7 usable pages = 28 steps: less than the 60-step sequence
    table: list[int] = []
    rng = torch.Generator().manual_seed(0)
    t = 0
    while t < 60:
        n = min(60 - t, int(torch.randint(1, 4, (1,), generator=rng)))  # decode steps and short extends
        for i, p in enumerate(table):
            if p and (i + 1) * page_size <= t - cfg.sliding_window + 1:  # no query from t on sees its steps
                table[i] = 0
                for layer in range(cfg.num_hidden_layers):
                    pages.k[layer][p] = pages.v[layer][p] = 1e4
                pages.free.append(p)
        while len(table) * page_size < t + n:
            table.append(pages.free.pop())
        batch = PagedBatch.build([t], [n], [table], page_size)
        out = model.forward_paged(toks[t : t + n], batch, pages.k, pages.v)
        t += n
        assert (out.state[0] - ref[t - 1]).abs().max() <= 1e-4
        assert sum(1 for p in table if p) <= cfg.sliding_window // page_size + 2


# ---- generation, sampling -----------------------------------------------------------------------------------------


def generate(model: S2SModel, prompts: list[torch.Tensor], frames: int, params: list[SamplingParams]) -> list:
    """Prefill each prompt, then decode `frames` steps; the user stream is silent, the model stream is sampled."""
    cfg = model.config
    pages = Pages(cfg, page_size=16)
    gens = [p.generator() for p in params]
    out, _ = pages.step(model, [(s, p, 0) for s, p in enumerate(prompts)])
    lens = [len(p) for p in prompts]
    produced = [[] for _ in prompts]
    for _ in range(frames):
        nxt = sample(out.state, params, gens, banned_id=cfg.pad_id)
        steps = []
        for s, codes in enumerate(nxt):
            user = torch.full((cfg.num_codebooks,), cfg.silent_id)
            tok = torch.cat([user, codes])[None]
            produced[s].append(codes)
            steps.append((s, tok, lens[s]))
            lens[s] += 1
        out, _ = pages.step(model, steps)
    return [torch.stack(p) for p in produced]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=50, seed=7)])
def test_generation_alone_equals_in_batch(tiny: S2SModel, params: SamplingParams) -> None:
    cfg = tiny.config
    prompts = [random_tokens(cfg, 10 + 3 * i, seed=i) for i in range(8)]
    others = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i) for i in range(7)]
    alone = generate(tiny, prompts[:1], 50, [params])[0]
    together = generate(tiny, prompts, 50, [params, *others])[0]
    assert torch.equal(alone, together)
    assert (alone != cfg.pad_id).all()


def test_top_k_without_nucleus_draws_what_the_sorted_vocabulary_draws() -> None:
    """Rows with top_p 1 take `topk` of their largest k, not a sort of the whole vocabulary: the same draw."""
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        scaled = 3 * torch.randn(8, 2, 1027, generator=g)
        numbers = torch.rand(8, 2, 1027, generator=g)

        def noise(ids: torch.Tensor, numbers: torch.Tensor = numbers) -> torch.Tensor:
            return numbers.gather(-1, ids)

        top_k = torch.tensor([250, 50, 1027, 1] * 2, dtype=torch.float)[:, None, None]
        assert torch.equal(_top_k(scaled, noise, top_k, 1027), _top_k_top_p(scaled, noise, top_k, torch.ones(8)))
        same = torch.full_like(top_k, 250)
        unsorted = _top_k(scaled, noise, None, 250)  # (every row's k the largest)
        assert torch.equal(unsorted, _top_k_top_p(scaled, noise, same, torch.ones(8)))


def test_a_top_k_past_the_vocabulary_cuts_nothing() -> None:
    """The default top_k (250) over a small vocabulary draws from all of it, as top_k 0 does, with or without a
    nucleus: not a `topk` that raises in the engine's thread."""
    logits = torch.randn(3, 2, 67, generator=torch.Generator().manual_seed(0))
    for top_p in (1.0, 0.9):
        draws = [
            sample(logits, [SamplingParams(top_k=k, top_p=top_p)] * 3, [RandomStream(s) for s in range(3)])
            for k in (250, 0)
        ]
        assert torch.equal(*draws)


@pytest.mark.parametrize("across", ["seeds", "draws"])
def test_counter_based_draws_follow_the_distribution(across: str) -> None:
    """The hashed numbers are uniform enough for Gumbel-max to draw each id at its probability: over 8,000 rows of
    consecutive seeds in one call, and over 8,000 draws of one seed; and one key draws the same again."""
    probs = torch.tensor([0.05, 0.15, 0.3, 0.5])
    params = SamplingParams(temperature=1.0, top_k=0)
    if across == "seeds":
        logits = probs.log().expand(8000, 2, 4)
        picks = sample(logits, [params] * 8000, [RandomStream(seed) for seed in range(8000)])
    else:
        stream = RandomStream(12345)
        picks = torch.cat([sample(probs.log().expand(1, 2, 4), [params], [stream]) for _ in range(8000)])
        assert stream.draws == 8000
    for k in range(2):
        share = torch.bincount(picks[:, k], minlength=4).float() / len(picks)
        assert (share - probs).abs().max() < 0.02, share  # about 4 standard deviations
    assert (picks[:, 0] != picks[:, 1]).float().mean() > 0.5  # the codebooks' numbers differ
    again = sample(probs.log().expand(3, 2, 4), [params] * 3, [RandomStream(7, draws=41) for _ in range(3)])
    assert (again == again[0]).all()


def test_sampling_rules() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 50, generator=g)
    gens = [RandomStream(i) for i in range(3)]
    greedy = sample(logits, [SamplingParams(temperature=0)] * 3, gens)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(sample(logits, [SamplingParams(top_k=1)] * 3, gens), greedy)
    assert torch.equal(sample(logits, [SamplingParams(top_p=1e-6)] * 3, gens), greedy)
    banned = logits.argmax(-1)[0, 0].item()
    picked = sample(logits, [SamplingParams(temperature=0)] * 3, gens, banned_id=banned)
    assert (picked != banned).all()
    draws = [
        sample(
            logits,
            [SamplingParams(seed=5, temperature=1.0, top_k=0)] * 3,
            [SamplingParams(seed=5).generator() for _ in range(3)],
        )
        for _ in range(2)
    ]
    assert torch.equal(draws[0], draws[1])
    top5 = logits.topk(5, dim=-1).indices
    for _ in range(20):
        pick = sample(logits, [SamplingParams(temperature=2.0, top_k=5)] * 3, gens)
        assert (top5 == pick[..., None]).any(-1).all()
    for bad in (dict(temperature=-1), dict(top_k=-2), dict(top_p=0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---- weights on disk -----------------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path, tiny: S2SModel) -> None:
    tiny.save_pretrained(tmp_path)
    again = S2SModel.from_pretrained(tmp_path)
    toks = random_tokens(tiny.config, 12, seed=1)[None]
    assert torch.equal(again(toks), tiny(toks))
    with pytest.raises(FileNotFoundError):
        S2SModel.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize("head", [LlamaModel, LlamaForCausalLM])
def test_load_backbone_from_transformers_llama(tmp_path, head) -> None:
    cfg = ModelConfig.preset("tiny", rope_theta=500000.0)
    torch.manual_seed(3)
    llama = head(cfg.to_llama_config()).eval()
    llama.save_pretrained(tmp_path)
    model = S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0)
    model.load_backbone(tmp_path)
    assert model.config.rope_theta == 500000.0
    x = torch.randn(2, 11, cfg.hidden_size)
    base = llama.model if head is LlamaForCausalLM else llama
    with torch.no_grad():
        want = base(inputs_embeds=x).last_hidden_state
    assert (model.backbone(x) - want).abs().max() <= 1e-4


def test_load_backbone_mismatch(tmp_path) -> None:
    LlamaModel(
        LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=10)
    ).save_pretrained(tmp_path)
    model = S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0)
    with pytest.raises(ValueError, match="hidden_size: checkpoint 32 vs model 64"):
        model.load_backbone(tmp_path)
    with pytest.raises(FileNotFoundError):
        model.load_backbone(tmp_path / "missing")


def test_bad_tokens(tiny: S2SModel) -> None:
    with pytest.raises(ValueError, match="codes"):
        tiny(torch.zeros(1, 3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 1027\)"):
        tiny(torch.full((1, 3, 4), 5000))


def test_rope_keeps_float32_frequencies_in_a_bf16_model() -> None:
    """A model cast to bf16 (as on a GPU) turns at the same angles as in float32: a bf16 frequency would be 0.4 % off,
    radians by the tens at step 3,000."""
    cfg = ModelConfig.preset("tiny")
    positions = torch.tensor([0, 1, 3000, 270_000])
    fp32 = S2SModel.from_seed(cfg, seed=0).backbone.rotary.cos_sin(positions, torch.float32)
    bf16 = S2SModel.from_seed(cfg, seed=0, dtype=torch.bfloat16).backbone.rotary.cos_sin(positions, torch.float32)
    for a, b in zip(fp32, bf16, strict=True):
        assert torch.equal(a, b)


def test_a_cpu_tick_flushes_denormals_and_stops_after() -> None:
    """The runner's CPU context (`ModelRunner.on_device`, around every tick) computes denormals as zeros, which a
    CPU otherwise multiplies through a slow microcode assist, and turns that off when the tick ends (torch has no
    way to read the mode a thread had: it is off unless something set it)."""
    from s2s.runner.model_runner import flushing_denormals

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    tiny = torch.tensor([1e-40])
    with flushing_denormals():
        assert (tiny * 1.0).item() == 0.0
    assert (tiny * 1.0).item() != 0.0
