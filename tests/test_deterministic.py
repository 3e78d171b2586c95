"""Deterministic mode through the server: the same seed, input and weights give the same reply bytes, whatever else
the server is doing, however the audio arrived, and whatever the cache mode."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from s2s import Engine, EngineConfig
from server.app import ChatServer, ServerOptions
from server.client import talk


def speech(seconds: float, seed: int) -> np.ndarray:
    t = np.arange(int(seconds * 24000)) / 24000
    rng = np.random.default_rng(seed)
    return (0.2 * np.sin(2 * np.pi * (140 + 30 * seed) * t) * (0.5 + 0.5 * rng.random(len(t)))).astype(np.float32)


def replies(parts, cache_mode: str, deterministic: bool, crowded: bool, **sampling: str) -> bytes:
    """The reply to one turn (pcm16 bytes), alone at real time, or at 4x beside three other conversations."""
    model, tok = parts
    cfg = EngineConfig(
        cache_mode=cache_mode,
        num_pages=512,
        max_context=1024,
        max_reply_frames=24,
        calibration_ticks=0,
        deterministic=deterministic,
    )

    async def main() -> bytes:
        server = ChatServer(Engine(model, tok, cfg), ServerOptions(port=0))
        url = f"ws://127.0.0.1:{await server.start()}"
        try:
            ours = talk(url, speech(0.6, seed=0), speed=4.0 if crowded else 1.0, listen_s=60.0, **sampling)
            others = [talk(url, speech(0.4 + 0.2 * i, seed=i), speed=2.0, listen_s=60.0) for i in (1, 2, 3)]
            results = await asyncio.gather(ours, *(others if crowded else []))
        finally:
            await server.stop()
        assert all(r.handshake and not r.errors for r in results), [r.errors for r in results]
        reply = results[0].reply
        assert len(reply) >= 320, "no reply"
        return (np.clip(reply, -1, 1) * 32767).astype("<i2").tobytes()

    return asyncio.run(main())


@pytest.mark.parametrize("sampling", [{"temperature": "0"}, {"temperature": "1", "seed": "5"}], ids=["greedy", "seed"])
def test_a_reply_does_not_depend_on_load_arrival_or_cache_mode(parts, sampling) -> None:
    reference = replies(parts, "naive", True, crowded=False, **sampling)
    for mode in ("naive", "radix"):
        assert replies(parts, mode, True, crowded=True, **sampling) == reference, mode
    assert replies(parts, "radix", True, crowded=False, **sampling) == reference
