"""Scheduler: what each tick's single batched forward computes.

Every conversation whose next step is known and leads to a sampled frame decodes one step (duplex steps and turn
replies: these are the deadlines, and admission control keeps them affordable). Prefill (voice prompts, a turn's user
frames) shares a per-tick step budget. Urgent prefill goes first, longest waiting first: a turn whose user has
stopped speaking (its time to first audio is running) and a duplex stream already live (its frame deadlines are).
The rest is background (a prompt or a turn's speech computed while the user still talks, which the speech hides):
most cached steps first, with aging so that a cold conversation is not starved by a stream of warm ones (sglang
#31954). In a tick someone waits on (urgent prefill, or a turn's reply before its first audio has left), background
prefill gets at most `background_budget` steps: that tick's length is someone's time to first audio, and work the
speech hides can wait one tick (vLLM caps long prefills per step for the same reason, `long_prefill_token_threshold`).
Where the cache shares prefixes (`page_size` given), of the conversations about to compute the same next page on the
same cached prefix only the first goes this tick: the others take its pages from the cache next tick instead of
computing them again (SGLang's in-batch prefix caching).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from s2s.conversation import Conversation, Phase

AGING_STEPS_PER_S = 2000.0  # a second of waiting counts like this many cached steps


@dataclass
class Work:
    conv: Conversation
    tokens: np.ndarray  # [n, 2K] step tokens to compute
    decode: bool  # one step whose logits are sampled (a frame deadline depends on it)


class Scheduler:
    def __init__(self, prefill_budget: int, background_budget: int, page_size: int | None = None):
        if min(prefill_budget, background_budget) < 1:
            raise ValueError(
                f"prefill_budget and background_budget must be >= 1, got {prefill_budget} and {background_budget}"
            )
        self.prefill_budget, self.background_budget, self.page_size = prefill_budget, background_budget, page_size
        self._waiting_since: dict[str, float] = {}

    def pick(
        self, convs: list[Conversation], now: float, deadline: Callable[[Conversation], float], prefill: bool = True
    ) -> list[Work]:
        """This round's work; `prefill=False` for the extra rounds of a multi-frame tick (decode steps only)."""
        decode, waiting = [], []
        for conv in convs:
            if conv.dormant:  # preempted while idle: nothing to compute until its user speaks again
                self._waiting_since.pop(conv.id, None)
                continue
            tokens = conv.ready_steps(self.prefill_budget if prefill else 2)
            if not len(tokens):
                self._waiting_since.pop(conv.id, None)
                continue
            if len(tokens) == 1 and conv.wanted_after(1):
                decode.append(Work(conv, tokens, True))
            elif prefill:
                waiting.append((conv, tokens))
        decode.sort(key=lambda w: deadline(w.conv))
        work = list(decode)
        for conv, _ in waiting:
            self._waiting_since.setdefault(conv.id, now)

        def order(ct: tuple[Conversation, np.ndarray]) -> tuple[bool, float]:
            conv, waited = ct[0], now - self._waiting_since[ct[0].id]
            if urgent(conv):
                return False, -waited
            return True, -(conv.computed + AGING_STEPS_PER_S * waited)

        waiting.sort(key=order)
        waited_on = any(urgent(c) for c, _ in waiting) or any(first_audio_due(w.conv) for w in decode)
        budget = self.prefill_budget
        leaders: set[tuple] = set()
        for conv, tokens in waiting:
            if waited_on and not urgent(conv):  # the urgent work is all taken (it sorts first)
                budget, waited_on = min(budget, self.background_budget), False
            if budget <= 0:
                break
            if self.page_size is not None and len(tokens) > self.page_size:  # as `Engine._rematch` requires
                shared = (
                    conv.computed,
                    tuple(conv.pages[: conv.computed // self.page_size]),
                    tokens[: self.page_size].tobytes(),
                )
                if shared in leaders:
                    continue  # another conversation computes this page now; this one re-matches it next tick
                leaders.add(shared)
            take = tokens[:budget]
            budget -= len(take)
            work.append(Work(conv, take, False))
            if len(take) == len(tokens):
                self._waiting_since.pop(conv.id, None)
        return work


def urgent(conv: Conversation) -> bool:
    """Someone is waiting on this conversation's prefill: a turn that is to be answered, or a live duplex stream."""
    if conv.mode == "duplex":
        return conv.first_frame_at is not None
    return conv.phase is Phase.REPLY


def first_audio_due(conv: Conversation) -> bool:
    """A turn's reply is computing towards its first audio: the user is waiting for it."""
    return conv.mode == "turn" and conv.phase is Phase.REPLY and conv.emitted == conv.turns[-1].reply_start
