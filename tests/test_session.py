"""s2s/conversation.py: the vectorized step views (`known_key`, `ready_steps`, `key`) agree with `step_token`."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s2s import ModelConfig, SamplingParams
from s2s.engine.session import UNKNOWN, Session


def by_steps(conv: Session, start: int, limit: int) -> list[np.ndarray]:
    out = []
    for t in range(start, start + limit):
        token = conv.step_token(t)
        if token is None:
            break
        out.append(token)
    return out


@settings(max_examples=60, deadline=None)
@given(
    delays=st.lists(st.integers(0, 3), min_size=2, max_size=3),
    user_frames=st.integers(0, 40),
    model_frames=st.integers(0, 40),
    hole=st.integers(0, 45),
    computed=st.integers(0, 45),
    limit=st.integers(1, 20),
)
def test_step_views_agree_with_step_token(delays, user_frames, model_frames, hole, computed, limit) -> None:
    cfg = ModelConfig.preset("tiny", num_codebooks=len(delays), delays=delays)
    conv = Session("c", "turn", cfg, SamplingParams(), 0, 0.0, frame_size=320)
    conv._ensure(max(user_frames, model_frames) + 1)
    rng = np.random.default_rng(user_frames * 100 + model_frames)
    conv.user[:user_frames] = rng.integers(0, cfg.codebook_size, size=(user_frames, len(delays)))
    conv.model[:model_frames] = rng.integers(0, cfg.codebook_size, size=(model_frames, len(delays)))
    if hole < len(conv.model):
        conv.model[hole, rng.integers(len(delays))] = UNKNOWN  # one unknown code inside the known frames
    conv.computed = computed

    assert all(conv.step_known(t) == (conv.step_token(t) is not None) for t in range(computed, computed + limit))
    known = len(by_steps(conv, 0, 10_000))
    assert len(conv.known_key()) == known
    ready = by_steps(conv, computed, limit)
    got = conv.ready_steps(limit)
    assert got.shape == (len(ready), 2 * len(delays))
    assert all(np.array_equal(a, b) for a, b in zip(got, ready, strict=True))
    if known:
        assert np.array_equal(conv.key(known), np.stack(by_steps(conv, 0, known)))
        assert np.array_equal(conv.known_key(), conv.key(known))


@settings(max_examples=60, deadline=None)
@given(
    delays=st.lists(st.integers(0, 3), min_size=2, max_size=3),
    known=st.integers(1, 120),
    keep=st.integers(0, 8),
    forget_to=st.integers(0, 120),
    start=st.integers(0, 130),
    length=st.integers(1, 7),
)
def test_recent_tokens_read_what_the_frames_hold(delays, known, keep, forget_to, start, length) -> None:
    """The quick read of recent steps (`recent_tokens`) equals the streams' general read (`gather`),
    however they have grown and forgotten their middle; a step before the recent frames raises."""
    cfg = ModelConfig.preset("tiny", num_codebooks=len(delays), delays=delays)
    conv = Session("c", "duplex", cfg, SamplingParams(), 0, 0.0, frame_size=320)
    conv._ensure(known + 1)
    rng = np.random.default_rng(known)
    conv.user[:known] = rng.integers(0, cfg.codebook_size, size=(known, len(delays)))
    conv.model[:known] = rng.integers(0, cfg.codebook_size, size=(known, len(delays)))
    if keep < forget_to < known:
        conv.user.forget(keep, forget_to)
        conv.model.forget(keep, forget_to)
    stop, k = start + length, np.arange(len(delays))
    if start - max(delays) < conv.user.start:
        with pytest.raises(IndexError):
            conv.recent_tokens(start, stop)
        return
    frames = np.arange(start, stop)[:, None] - np.asarray(delays)[None, :]
    want = np.concatenate([conv.user.gather(frames, k[None, :]), conv.model.gather(frames, k[None, :])], axis=1)
    assert np.array_equal(conv.recent_tokens(start, stop), want)
