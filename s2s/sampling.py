"""Sampling per sequence and codebook: greedy, temperature, top-k, top-p, with one seeded generator per sequence.

Each sequence's random numbers come from its own `torch.Generator`, drawn in the same amount every step, so its
output depends only on its seed, its logits and its step count: never on what else is in the batch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8  # 0 means greedy
    top_k: int = 250  # 0 means no top-k cut
    top_p: float = 1.0  # 1 means no nucleus cut
    seed: int | None = None

    def __post_init__(self) -> None:
        """Types too: these often come from clients (a JSON `true` is an int to Python, `1e400` an overflow)."""
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
            try:
                object.__setattr__(self, name, float(value))
            except OverflowError:
                raise ValueError(f"{name} must be finite, got a number of {len(str(value))} digits") from None
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            if (value is not None or name == "top_k") and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be a whole number, got {value!r}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator:
        """A fresh generator for one sequence: from `seed`, or from the process's entropy when there is none."""
        seed = self.seed if self.seed is not None else random.SystemRandom().randrange(2**63)
        return torch.Generator(device=device).manual_seed(seed)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    banned_id: int | None = None,
) -> torch.Tensor:
    """Logits `[S, K, V]` -> token ids `[S, K]`. `banned_id` (the delay padding id) is never chosen."""
    num_seqs, _, vocab = logits.shape
    if len(params) != num_seqs or len(generators) != num_seqs:
        raise ValueError(f"{num_seqs} sequences but {len(params)} params and {len(generators)} generators")
    logits = logits.float()
    if banned_id is not None:
        logits = logits.clone()
        logits[..., banned_id] = float("-inf")
    greedy = logits.argmax(-1)
    # One draw per sequence per step, whatever its settings, so its stream of random numbers never shifts.
    noise = torch.stack([torch.rand(logits.shape[1:], generator=g, device=g.device) for g in generators])
    noise = noise.to(logits.device)
    if all(p.temperature == 0 for p in params):
        return greedy

    temps = logits.new_tensor([max(p.temperature, 1e-6) for p in params])[:, None, None]
    sorted_logits, order = (logits / temps).sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    top_k = logits.new_tensor([p.top_k if p.top_k > 0 else vocab for p in params])[:, None, None]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, float("-inf"))
    probs = sorted_logits.softmax(-1)  # top-p applies to what top-k kept, as in vLLM
    top_p = logits.new_tensor([p.top_p for p in params])[:, None, None]
    keep = (probs.cumsum(-1) - probs) < top_p  # the first token is always kept
    gumbel = -torch.log(-torch.log(noise.clamp_min(1e-20)))
    # the noise is indexed by vocabulary id, not by rank, so ties in sorting cannot change the draw
    scores = torch.where(keep, sorted_logits + gumbel.gather(-1, order), float("-inf"))
    sampled = order.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
    is_greedy = logits.new_tensor([p.temperature == 0 for p in params], dtype=torch.bool)[:, None]
    return torch.where(is_greedy, greedy, sampled)
