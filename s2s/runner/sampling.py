"""Sampling per sequence and codebook: greedy, temperature, top-k, top-p, with one seeded stream of random numbers
per sequence.

A sequence's random numbers are counter-based (as Philox is): a hash of its seed, its draw count and the (codebook,
vocabulary id) a number is for. So its output depends only on its seed, its logits and its step count, never on what
else is in the batch, and a batch's numbers are a few elementwise ops over the candidates it samples from: not a
generator call per sequence over its whole vocabulary, which was a launch per row on a GPU, most of a CPU tick's
sampling at hundreds of conversations, and nothing a CUDA graph can hold.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
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

    def generator(self) -> RandomStream:
        """A fresh stream for one sequence: from `seed`, or from the process's entropy when there is none."""
        return RandomStream(self.seed if self.seed is not None else random.SystemRandom().randrange(2**63))


@dataclass
class RandomStream:
    """One sequence's random numbers: keyed by `seed`; `draws` counts the steps it has sampled (`sample` adds one)."""

    seed: int
    draws: int = 0


MASK32 = 0xFFFFFFFF
Bits = TypeVar("Bits", torch.Tensor, np.ndarray)


def _fmix32(x: Bits) -> Bits:
    """MurmurHash3's 32-bit finalizer on int64 tensors (or uint64 arrays) holding 32-bit values (products wrap; the
    mask keeps 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def _keys(streams: list[RandomStream], device: torch.device) -> torch.Tensor:
    """Each stream's key for its next draw: its seed and draw count hashed to 32 bits, `[S]`. Hashed on the host in
    numpy's uint64 (its products wrap as torch's int64 do, and the mask keeps the same 32 bits): forty elementwise
    ops on a few numbers, which cost torch a dispatch each."""
    seeds = np.array([st.seed for st in streams], dtype=np.uint64)
    draws = np.array([st.draws for st in streams], dtype=np.uint64)
    key = _fmix32(_fmix32(seeds & MASK32) ^ (seeds >> 32))
    key = _fmix32(key ^ (draws & MASK32) ^ ((draws >> 32) * 0x9E3779B9 & MASK32))
    return torch.from_numpy(key.astype(np.int64)).to(device)


def _uniform(keys: torch.Tensor, ids: torch.Tensor, vocab: int, first_codebook: int = 0) -> torch.Tensor:
    """Numbers in (0, 1) for vocabulary `ids` `[S, K, n]` of rows keyed by `keys` `[S]`: each a hash of (key,
    codebook, id), so it belongs to its id whatever else is drawn; the K codebooks are `first_codebook` on."""
    start, stop = first_codebook * vocab, (first_codebook + ids.shape[1]) * vocab
    codebook = torch.arange(start, stop, vocab, device=ids.device)[None, :, None]  # each codebook's first id
    x = (keys[:, None, None] + (codebook + ids) * 0x9E3779B9) & MASK32
    return _unit(_fmix32(_fmix32(x)))


def _unit(bits: torch.Tensor) -> torch.Tensor:
    """32 hashed bits to a number in (0, 1): the top 24, centred. The largest rounds up to 1.0 in float32, whose
    Gumbel noise is infinite (a candidate cut by top-k then scores NaN, which `argmax` picks): it is kept below 1."""
    return (((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24).clamp_max(1 - 2.0**-24)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    streams: list[RandomStream],
    banned_id: int | None = None,
) -> torch.Tensor:
    """Logits `[S, K, V]` -> token ids `[S, K]`; each stream counts one draw. `banned_id` (the delay padding id) is
    never chosen."""
    if not len(params) == len(streams) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} sequences but {len(params)} params and {len(streams)} streams")
    keys = _keys(streams, logits.device)
    for st in streams:  # one draw per sequence per step, whatever its settings, so its numbers never shift
        st.draws += 1
    return sample_keyed(logits, params, keys, banned_id)


def sample_keyed(
    logits: torch.Tensor,
    params: list[SamplingParams],
    keys: torch.Tensor,
    banned_id: int | None = None,
    first_codebook: int = 0,
) -> torch.Tensor:
    """`sample` with the rows' keys for this step given (`stream_keys`, the draw already counted): for a step whose
    codebooks are sampled in several calls, each call's logits `[S, K, V]` being codebooks `first_codebook` on."""
    num_seqs, _, vocab = logits.shape
    if len(params) != num_seqs or len(keys) != num_seqs:
        raise ValueError(f"{num_seqs} sequences but {len(params)} params and {len(keys)} keys")
    logits = logits.float()
    if banned_id is not None:
        logits = logits.clone()
        logits[..., banned_id] = float("-inf")
    is_greedy = [p.temperature == 0 for p in params]
    if all(is_greedy):
        return logits.argmax(-1)
    keys = keys.to(logits.device)
    sampled = None
    nucleus = [p.top_p < 1 for p in params]
    for with_nucleus in (True, False):
        rows = [i for i in range(num_seqs) if nucleus[i] == with_nucleus]
        if not rows:
            continue
        whole = len(rows) == num_seqs  # (the usual round: every row alike, sampled without a gather and a scatter)
        index = None if whole else torch.tensor(rows, device=logits.device)
        chosen = [params[i] for i in rows]
        temperatures = {max(p.temperature, 1e-6) for p in chosen}
        part, row_keys = (logits, keys) if whole else (logits[index], keys[index])
        if len(temperatures) == 1:  # (a division by a number: the same quotients as by a tensor of it)
            scaled = part / temperatures.pop()
        else:
            scaled = part / part.new_tensor([max(p.temperature, 1e-6) for p in chosen])[:, None, None]
        ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in chosen]  # a k past the vocabulary: all of it

        def noise(ids: torch.Tensor, row_keys: torch.Tensor = row_keys) -> torch.Tensor:
            return _uniform(row_keys, ids, vocab, first_codebook)

        if with_nucleus:
            top_p = scaled.new_tensor([p.top_p for p in chosen])
            drawn = _top_k_top_p(scaled, noise, logits.new_tensor(ks)[:, None, None], top_p)
        else:
            one_k = min(ks) == max(ks)
            drawn = _top_k(scaled, noise, None if one_k else logits.new_tensor(ks)[:, None, None], max(ks))
        if whole:
            sampled = drawn
        else:
            if sampled is None:
                sampled = torch.empty(logits.shape[:2], dtype=torch.long, device=logits.device)
            sampled[index] = drawn
    if not any(is_greedy):
        return sampled
    greedy_rows = logits.new_tensor(is_greedy, dtype=torch.bool)[:, None]
    return torch.where(greedy_rows, logits.argmax(-1), sampled)


def stream_keys(streams: list[RandomStream]) -> torch.Tensor:
    """Each stream's key for its next draw, on the host, and the draw counted: what `sample` does for its rows."""
    keys = _keys(streams, torch.device("cpu"))
    for st in streams:
        st.draws += 1
    return keys


def sample_static(
    logits: torch.Tensor,
    keys: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    banned_id: int | None = None,
    first_codebook: int = 0,
) -> torch.Tensor:
    """`sample` with each row's settings as tensors `[S]` (`keys` from `stream_keys`; `top_k` 0: no cut), as one
    fixed sequence of ops whatever the settings, so a CUDA graph can hold it: every row takes the sort of the whole
    vocabulary (`_top_k_top_p`, which with top_p 1 draws what `_top_k` draws). It chooses what `sample` does, but
    where logits tie at a row's top-k cut (bf16 logits can): `sort` and `topk` may keep different ones of the tied.
    `first_codebook`: as `sample_keyed`'s."""
    vocab = logits.shape[-1]
    logits = logits.float()
    if banned_id is not None:
        logits = logits.clone()  # (a float input is returned as it is: the caller's)
        logits[..., banned_id] = float("-inf")
    greedy = logits.argmax(-1)
    scaled = logits / temperature.clamp_min(1e-6)[:, None, None]
    ks = torch.where(top_k > 0, top_k.clamp_max(vocab), vocab)[:, None, None]
    sampled = _top_k_top_p(scaled, lambda ids: _uniform(keys, ids, vocab, first_codebook), ks, top_p)
    return torch.where((temperature == 0)[:, None], greedy, sampled)


Noise = Callable[[torch.Tensor], torch.Tensor]  # vocabulary ids [S, K, n] -> their numbers in (0, 1)


def _gumbel(noise: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(noise.clamp_min(1e-20)))


def _top_k_top_p(scaled: torch.Tensor, noise: Noise, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Gumbel-max within the top-k, then the top-p of what it kept (as vLLM): a sort of the whole vocabulary."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, float("-inf"))
    probs = sorted_logits.softmax(-1)
    keep = (probs.cumsum(-1) - probs) < top_p[:, None, None]  # the first token is always kept
    # the noise is indexed by vocabulary id, not by rank, so ties in sorting cannot change the draw
    scores = torch.where(keep, sorted_logits + _gumbel(noise(order)), float("-inf"))
    return order.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)


def _top_k(scaled: torch.Tensor, noise: Noise, top_k: torch.Tensor | None, largest: int) -> torch.Tensor:
    """Gumbel-max within the top-k (no nucleus): `topk` of the `largest` k asked for (known on the host: no device
    sync), not a sort of the whole vocabulary, which was most of a CPU tick's sampling at hundreds of conversations.
    `top_k` None: every row asks for `largest`, so the candidates need no order (an unsorted `topk`, 40 % less on
    CPU) and no cut."""
    values, ids = scaled.topk(largest, dim=-1, sorted=top_k is not None)
    if top_k is not None:
        rank = torch.arange(values.shape[-1], device=scaled.device)
        values = values.masked_fill(rank >= top_k, float("-inf"))
    scores = values + _gumbel(noise(ids))
    return ids.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
