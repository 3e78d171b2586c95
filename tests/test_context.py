"""The bounded context (`s2s/scheduling/context.py`): over many windows a conversation holds a flat number of pages,
and what it predicts is what a full forward with the sink-and-window mask predicts; pause and restart."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine.engine import Engine, EngineConfig, MetaEvent
from s2s.engine.turns import Phase
from s2s.models.backbone import Backbone

GREEDY = SamplingParams(temperature=0)
PS = 16
WINDOW = 48  # steps: 3 pages
CFG = ModelConfig.preset("tiny", num_codebooks=2, codebook_size=64)


@pytest.fixture(scope="module")
def model() -> S2SModel:
    return S2SModel.from_seed(CFG, seed=1)


def make(model: S2SModel, **kw) -> Engine:
    cfg = dict(max_context=WINDOW, num_pages=64, calibration_ticks=0, max_reply_frames=20, frames_per_tick=4)
    return Engine(model, None, EngineConfig(**(cfg | kw)))


def masked_forward(model: S2SModel, tokens: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Reference: step tokens `[T, 2K]` -> logits `[T, K, V]`, query i attending to keys j where `visible[i, j]`."""
    backbone: Backbone = model.backbone
    x = model.embed(tokens[None])
    cos, sin = backbone.rotary.cos_sin(torch.arange(len(tokens)), x.dtype)
    for layer in backbone.layers:
        attn = layer.self_attn
        q, k, v = (t.transpose(1, 2) for t in attn._qkv(layer.input_layernorm(x), cos, sin))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))
        x = layer._mlp_block(x)
    return model.logits(backbone.norm(x))[0]


def sink_and_window(steps: int, sink: int, window_pages: int) -> torch.Tensor:
    pos = torch.arange(steps)
    q_page, k_page = (pos // PS)[:, None], (pos // PS)[None, :]
    start = torch.clamp(q_page - window_pages + 1, min=sink)
    return (pos[None, :] <= pos[:, None]) & ((k_page < sink) | (k_page >= start))


class Recorder:
    """Both streams as the engine finalises them: frames every step before `computed` has read (the engine itself
    forgets them once they leave the window)."""

    def __init__(self, k: int):
        self.user, self.model = np.zeros((0, k), np.int64), np.zeros((0, k), np.int64)

    def take(self, s) -> None:
        stop = s.computed - s.cfg.max_delay
        if stop > len(self.user):
            self.user = np.concatenate([self.user, s.user[len(self.user) : stop]])
            self.model = np.concatenate([self.model, s.model[len(self.model) : stop]])

    def steps(self, cfg: ModelConfig, n: int) -> torch.Tensor:
        frames = np.arange(n)[:, None] - np.asarray(cfg.delays)[None, :]
        cols = np.arange(cfg.num_codebooks)[None, :]
        safe = np.maximum(frames, 0)
        user = np.where(frames < 0, cfg.pad_id, self.user[safe, cols])
        model = np.where(frames < 0, cfg.pad_id, self.model[safe, cols])
        return torch.from_numpy(np.concatenate([user, model], axis=1))


def predicted_agree(model: S2SModel, rec: Recorder, predicted: list[int], sink: int, window_pages: int | None):
    """(agreeing, compared): the engine's greedy codes of `predicted` frames against the reference's argmax, where
    the reference is sure (top two logits apart by more than 1e-3)."""
    cfg = model.config
    n = len(rec.user)
    tokens = rec.steps(cfg, n)
    mask = sink_and_window(n, sink, window_pages) if window_pages else torch.ones(n, n).tril().bool()
    logits = masked_forward(model, tokens, mask)
    logits[..., cfg.pad_id] = -torch.inf
    top2 = logits.topk(2, dim=-1)
    agree = compared = 0
    for f in predicted:
        for k, d in enumerate(cfg.delays):
            step = f + d - 1
            if step >= n or f >= n or top2.values[step, k, 0] - top2.values[step, k, 1] < 1e-3:
                continue
            compared += 1
            agree += int(top2.indices[step, k, 0]) == int(rec.model[f, k])
    return agree, compared


def test_a_duplex_conversation_holds_its_bound_over_20_windows_and_predicts_what_the_mask_says(model) -> None:
    engine = make(model)
    prompt = np.random.default_rng(0).integers(0, 64, (2, 20))  # a voice prompt: a sink of 2 pages
    cid = engine.open("duplex", prompt=prompt, sampling=GREEDY)
    rng = np.random.default_rng(1)
    rec, steps = Recorder(2), 20 + 20 * WINDOW
    held = []
    for _ in range(steps // 4):
        engine.push_codes(cid, rng.integers(0, 64, (2, 4)))
        engine.step()
        s = engine.sessions[cid]
        rec.take(s)
        held.append(len(s.pages))
        engine.cache.check()
    s = engine.sessions[cid]
    bound = engine.bound
    assert s.sink == 2 and s.dropped >= 18 * bound.window_pages
    assert max(held) <= bound.max_pages(s.sink, "duplex") == 5
    assert held[-1] == max(held[len(held) // 2 :])  # flat: past the first window it holds the same
    stats = engine.cache.stats()
    assert stats.private + stats.cached_locked <= bound.max_pages(s.sink, "duplex")
    assert len(s.user.data) <= 4 * WINDOW  # its frames are flat too
    predicted = list(range(20, len(rec.user)))
    agree, compared = predicted_agree(model, rec, predicted, s.sink, bound.window_pages)
    assert compared > 1000 and agree == compared
    unbounded, compared = predicted_agree(model, rec, predicted, s.sink, None)
    assert unbounded < 0.9 * compared  # the control: what it attends to changes what it says


def test_turns_trim_oldest_first_and_a_shared_prompt_stays_cached(model) -> None:
    engine = make(model)
    prompt = np.random.default_rng(2).integers(0, 64, (2, 40))
    engine.add_voice("v", prompt)
    cid = engine.open("turn", prompt="v", sampling=GREEDY)
    rng, rec = np.random.default_rng(3), Recorder(2)
    replies = []
    for _ in range(12):  # each turn: 30 frames of speech and a reply of up to 20: 12 turns, 10 windows
        for _ in range(0, 30, 6):
            engine.push_codes(cid, rng.integers(0, 64, (2, 6)))
            engine.step()
            rec.take(engine.sessions[cid])
        engine.end_turn(cid)
        for _ in range(100):
            engine.step()
            s = engine.sessions[cid]
            rec.take(s)
            assert len(s.pages) <= engine.bound.max_pages(s.sink, "turn")
            if s.phase is Phase.LISTEN and s.turns[-1].reply_end is not None:
                break
        replies.append((s.turns[-1].reply_start, s.turns[-1].reply_end))
    s = engine.sessions[cid]
    assert s.dropped > 0 and len(s.turns) == 12
    assert s.user.start > replies[3][1]  # the first turns' frames are gone
    predicted = [f for a, b in replies for f in range(a, b)]
    agree, compared = predicted_agree(model, rec, predicted, s.sink, engine.bound.window_pages)
    assert compared > 100 and agree == compared
    second = engine.open("turn", prompt="v", sampling=GREEDY, admit=False)  # the prompt's pages are still shared
    engine.step()
    assert engine.sessions[second].cached_at_open >= 32


def test_a_paused_conversation_takes_no_steps_and_resumes_with_its_context(model) -> None:
    engine = make(model)
    a, b = engine.open("duplex", sampling=GREEDY), engine.open("duplex", sampling=GREEDY)
    rng = np.random.default_rng(4)
    for _ in range(5):
        for cid in (a, b):
            engine.push_codes(cid, rng.integers(0, 64, (2, 4)))
        engine.step()
    sa = engine.sessions[a]
    before = (sa.computed, sa.user_frames, list(sa.pages))
    engine.pause(a)
    for _ in range(5):
        for cid in (a, b):
            engine.push_codes(cid, rng.integers(0, 64, (2, 4)))  # dropped while paused
        engine.step()
    assert (sa.computed, sa.user_frames, list(sa.pages)) == before
    assert engine.sessions[b].computed > before[0]
    engine.unpause(a)
    engine.push_codes(a, rng.integers(0, 64, (2, 4)))
    engine.step()
    assert sa.computed > before[0] and sa.pages[: len(before[2])] == before[2]
    q = engine.event_queue(a)
    events = [e.data["event"] for e in (q.get() for _ in range(q.qsize())) if isinstance(e, MetaEvent)]
    assert events == ["paused", "started"]


def test_a_paused_conversation_gives_its_pages_first_and_gets_its_context_back(model) -> None:
    """Paused, it is the first to give its pages up (6 usable: it holds 3, the other needs 4); unpaused, it goes on
    as if nothing had happened (deterministic mode: its K/V recomputed in other chunks are the same bits)."""
    rng = np.random.default_rng(5)
    codes, other = rng.integers(0, 64, (2, 60)), rng.integers(0, 64, (2, 80))
    said = []
    for pause in (False, True):
        engine = make(model, num_pages=7, deterministic=True)
        a, b = engine.open("duplex", sampling=GREEDY), engine.open("duplex", sampling=GREEDY)
        for f in range(0, 40, 4):
            engine.push_codes(a, codes[:, f : f + 4])
            engine.step()
        if pause:
            engine.pause(a)
            for f in range(0, 80, 4):
                engine.push_codes(b, other[:, f : f + 4])
                engine.step()
            assert engine.stats.preempted == 1 and engine.sessions[b].computed >= 70  # b took a's pages
            engine.unpause(a)
        for f in range(40, 60, 4):
            engine.push_codes(a, codes[:, f : f + 4])
            engine.step()
        for _ in range(3):
            engine.step()
        engine.cache.check()
        said.append(engine.sessions[a].model[:60].copy())
    assert np.array_equal(said[0], said[1])


def test_restart_takes_the_context_back_to_the_prompt(model) -> None:
    engine = make(model)
    prompt = np.random.default_rng(6).integers(0, 64, (2, 20))
    cid = engine.open("duplex", prompt=prompt, sampling=GREEDY)
    rng = np.random.default_rng(7)
    for _ in range(60):  # past the window: pages have left the table
        engine.push_codes(cid, rng.integers(0, 64, (2, 4)))
        engine.step()
    s = engine.sessions[cid]
    assert s.dropped > 0
    engine.restart(cid)
    engine.step()
    assert (s.user_frames, s.computed, s.dropped, len(s.turns)) == (20, 20, 0, 1)  # step 19 computed again
    assert s.turns[0].id == 0 and len(s.pages) == 2
    assert np.array_equal(s.model[:20], prompt.T)
    engine.cache.check()
    fresh = engine.open("duplex", prompt=prompt, sampling=GREEDY, admit=False)
    feed = rng.integers(0, 64, (2, 40))
    for f in range(0, 40, 4):
        for c in (cid, fresh):
            engine.push_codes(c, feed[:, f : f + 4])
        engine.step()
    assert np.array_equal(s.model[:50], engine.sessions[fresh].model[:50])  # as if it had just opened


def feed(engine: Engine, cid: str, frames: int, rng, chunk: int = 4) -> None:
    for _ in range(frames // chunk):
        engine.push_codes(cid, rng.integers(0, 64, (2, chunk)))
        engine.step()


def test_a_conversation_with_a_gap_preempted_or_resumed_recomputes_what_it_kept(model) -> None:
    """Its sink and then its kept window, each step seeing what is kept before it; it then goes on."""
    rng = np.random.default_rng(8)
    engine = make(model, num_pages=7)  # 6 usable: a holds 4, b needs 4
    a, b = engine.open("duplex", sampling=GREEDY), engine.open("duplex", sampling=GREEDY, admit=False)
    feed(engine, a, 100, rng)
    sa = engine.sessions[a]
    assert sa.dropped == 3
    engine.pause(a)
    feed(engine, b, 80, rng)
    assert engine.stats.preempted == 1 and not sa.pages
    engine.unpause(a)
    feed(engine, a, 8, rng)
    for _ in range(8):  # a page of its window a tick (each page sees its own window)
        engine.step()
    assert sa.computed >= 100 and sa.dropped == 3 and sa.pages
    engine.close(a, keep=True)
    engine.close(b)
    engine.step()
    engine.open("duplex", sampling=GREEDY, session_id=a, resume=True)
    feed(engine, a, 8, rng)
    for _ in range(8):
        engine.step()
    s = engine.sessions[a]
    assert s.computed >= 100 and s.emitted >= 100  # it does not send its history again
    engine.cache.check()


def test_a_rewind_after_a_preemption_keeps_the_gap(model) -> None:
    rng = np.random.default_rng(9)
    engine = make(model)
    a = engine.open("turn", sampling=GREEDY)
    for _ in range(4):
        feed(engine, a, 30, rng, 6)
        engine.end_turn(a)
        for _ in range(100):
            engine.step()
            s = engine.sessions[a]
            if s.phase is Phase.LISTEN and s.turns[-1].reply_end is not None:
                break
    assert s.dropped > 0
    engine.kv.preempt(s)  # what `reserve` does when `Scheduler.victim` names it
    engine.regenerate(a)
    for _ in range(40):
        engine.step()
    assert s.dropped > 0 and s.turns[-1].reply_end is not None and s.phase is Phase.LISTEN
    engine.cache.check()


def test_the_first_slide_leaves_no_page_unheld_and_pins_no_cached_chain(model) -> None:
    """Resumed, it matched pages past its sink: once its lock moves to the sink, it holds them itself. And a turn
    conversation's cached chain past its sink goes from the cache, so a pool of its bound plus one page is enough."""
    rng = np.random.default_rng(10)
    engine = make(model)
    a = engine.open("duplex", sampling=GREEDY, session_id="a")
    feed(engine, a, 60, rng)
    engine.close(a, keep=True)
    engine.step()
    engine.open("duplex", sampling=GREEDY, session_id="a", resume=True)
    feed(engine, a, 12, rng)
    s = engine.sessions[a]
    assert s.dropped and set(s.pages[s.sink :]) <= set(s.own_pages)
    engine.cache.check()
    bound = engine.bound.max_pages(1, "turn")
    tight = make(model, num_pages=bound + 2)
    t = tight.open("turn", sampling=GREEDY)
    for i in range(60):
        tight.push_codes(t, rng.integers(0, 64, (2, 4)))
        if i % 10 == 9:
            tight.end_turn(t)
        tight.step()
    s = tight.sessions[t]
    assert s.dropped and s.computed >= s.user_frames - 8 and tight.stats.out_of_pages == 0
    tight.cache.check()


def test_the_engine_checks_its_pages_once_each_time_the_last_conversation_goes(model) -> None:
    rng = np.random.default_rng(11)
    engine = make(model)
    for round_ in range(2):
        cid = engine.open("duplex", sampling=GREEDY, admit=False)
        feed(engine, cid, 8, rng)
        engine.close(cid)
        engine.step()
        engine.step()
        assert (engine.stats.kv_checks, engine.stats.kv_check_failures) == (round_ + 1, 0)
    cid = engine.open("duplex", sampling=GREEDY, admit=False)
    feed(engine, cid, 8, rng)
    leaked = engine.sessions[cid].own_pages.pop()  # a page nobody will give back
    engine.close(cid)
    engine.step()
    assert (engine.stats.kv_checks, engine.stats.kv_check_failures) == (3, 1)
    assert engine.cache.stats().private == 1 and leaked
