"""Deterministic mode through the server: the same seed, input and weights give the same reply bytes, whatever else
the server is doing, however the audio arrived, and whatever the cache mode."""

from __future__ import annotations

import asyncio

import pytest
from test_server import run_with_server, speech

from codec.pcm import to_pcm16
from server.moshi.client import talk

pytestmark = pytest.mark.paced  # servers at real time: alone and last (tests/conftest.py)


def replies(parts, cache_mode: str, deterministic: bool, crowded: bool, **sampling: str) -> bytes:
    """The reply to one turn (pcm16 bytes), alone at real time, or at 4x beside three other conversations."""

    async def body(url, server) -> bytes:
        ours = talk(url, speech(0.6, seed=0), speed=4.0 if crowded else 1.0, listen_s=60.0, **sampling)
        others = [talk(url, speech(0.4 + 0.2 * i, seed=i), speed=2.0, listen_s=60.0) for i in (1, 2, 3) if crowded]
        results = await asyncio.gather(ours, *others)
        assert all(r.handshake and not r.errors for r in results), [r.errors for r in results]
        reply = results[0].reply
        assert len(reply) >= 320, "no reply"
        return to_pcm16(reply)

    return run_with_server(parts, body, cache_mode=cache_mode, max_reply_frames=24, deterministic=deterministic)


@pytest.mark.parametrize("sampling", [{"temperature": "0"}, {"temperature": "1", "seed": "5"}], ids=["greedy", "seed"])
def test_a_reply_does_not_depend_on_load_arrival_or_cache_mode(parts, sampling) -> None:
    reference = replies(parts, "naive", True, crowded=False, **sampling)
    for mode in ("naive", "radix"):
        assert replies(parts, mode, True, crowded=True, **sampling) == reference, mode
    assert replies(parts, "radix", True, crowded=False, **sampling) == reference
