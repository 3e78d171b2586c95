"""EngineConfig: how a model is served (pages, batch, tick, budgets, admission)."""

from __future__ import annotations

from dataclasses import dataclass

from codec.pcm import FRAME_S


@dataclass
class EngineConfig:
    cache_mode: str = "radix"
    page_size: int = 16
    kv_budget_bytes: int | None = None
    num_pages: int | None = 4096  # used when kv_budget_bytes is None
    max_conversations: int = 32
    max_context: int = 2250  # steps a step attends to besides its sink (30 s: `ContextBound`); bounds its pages
    frames_per_tick: int = 1  # duplex steps per conversation per tick: the codec works on chunks this long
    prefill_budget: int = 256  # prefill steps per tick, all conversations together
    background_budget: int = 16  # of those, for work nobody waits on, in a tick someone waits on (`Scheduler`)
    jitter_buffer_s: float | None = None  # default: 80 ms (clients send 80 ms blocks) + one tick
    max_reply_frames: int = 750
    session_ttl_s: float = 300.0  # a closed conversation kept for a resume (`close(keep=True)`) is kept this long
    resumable_conversations: int = 256  # ... and at most this many of them, the oldest going first
    resumable_bytes: int = 64 << 20  # ... holding at most this much of their frames
    admission_headroom: float = 0.75  # admit while the predicted tick time stays under this share of tick_s
    calibration_ticks: int = 16  # ticks run at start on 1, 2 and 4 silent duplex conversations to seed the cost model
    cuda_graphs: bool = True  # on a GPU, replay single-step rounds from CUDA graphs (vLLM's default; off: eager)
    deterministic: bool = False  # a reply depends only on its seed, input and weights: not on batch, chunks or cache

    def __post_init__(self) -> None:
        if self.frames_per_tick < 1:
            raise ValueError(f"frames_per_tick must be >= 1, got {self.frames_per_tick}")
        if min(self.session_ttl_s, self.resumable_conversations, self.resumable_bytes) < 0:
            raise ValueError(
                "session_ttl_s, resumable_conversations and resumable_bytes must be >= 0, got "
                f"{self.session_ttl_s}, {self.resumable_conversations} and {self.resumable_bytes}"
            )
        if self.jitter_buffer_s is None:
            self.jitter_buffer_s = 0.08 + self.tick_s

    @property
    def tick_s(self) -> float:
        return self.frames_per_tick * FRAME_S
