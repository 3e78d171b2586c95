"""The fit table: how many conversations on one shared prompt a fixed pool of K/V pages holds in each mode."""

from __future__ import annotations

import numpy as np

from bench.prefix.config import MODES, Scale
from bench.prefix.engine_reads import bytes_per_page, prefill_pending
from bench.prefix.run import make_engine
from codec import EncodecTokenizer
from s2s import S2SModel, SamplingParams
from s2s.engine.engine import Refused


def fit_count(model: S2SModel, tok: EncodecTokenizer, mode: str, scale: Scale, clip_frames: int) -> dict:
    """Conversations on one shared prompt, each with its own tail (a turn's worth of codes), opened one at a time in
    a pool of `fit_pages`, each prefilled before the next opens, until one is refused or cannot get its pages
    without preempting a resident one (which the engine would do: then they no longer all fit). Naive stops when
    `open` refuses: it reserves `max_context` steps up front."""
    max_convs = 256
    engine = make_engine(model, tok, mode, scale.fit_pages + 1, scale, max_conversations=max_convs)
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 1024, size=(2, scale.prompt_frames))
    tail = clip_frames + scale.reply_frames
    fitted, reason = 0, f"max_conversations ({max_convs})"
    for i in range(max_convs):
        prompt = np.concatenate([shared, rng.integers(0, 1024, size=(2, tail))], axis=1)
        try:
            cid = engine.open("turn", prompt=prompt, sampling=SamplingParams(seed=i))
        except Refused:
            reason = "refused at open"
            break
        while prefill_pending(engine, cid) and not engine.stats.preempted:
            waits = engine.stats.out_of_pages
            engine.step()
            if engine.stats.out_of_pages > waits and prefill_pending(engine, cid):
                break
        if prefill_pending(engine, cid) or engine.stats.preempted:
            reason = "out of pages" + (": the next preempts a resident one" if engine.stats.preempted else "")
            break
        fitted += 1
    return {
        "workload": "fit",
        "mode": mode,
        "num_pages": scale.fit_pages,
        "kv_budget_bytes": scale.fit_pages * bytes_per_page(engine),
        "prompt_frames": scale.prompt_frames,
        "own_frames": tail,
        "conversations_fit": fitted,
        "stopped_by": reason,
    }


def fit_rows(model: S2SModel, tok: EncodecTokenizer, scale: Scale, clip_frames: int) -> list[dict]:
    """`fit_count` for every mode, each against naive's count."""
    fit = [fit_count(model, tok, mode, scale, clip_frames) for mode in MODES]
    naive = next(r["conversations_fit"] for r in fit if r["mode"] == "naive")
    for r in fit:
        r["vs_naive"] = r["conversations_fit"] / max(1, naive)
    return fit
