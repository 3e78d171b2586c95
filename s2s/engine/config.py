"""EngineConfig: how a model is served (pages, batch, frames and tick, budgets, admission)."""

from __future__ import annotations

from dataclasses import dataclass

from codec.pcm import SAMPLE_RATE

# A codec-free engine's frame (its sessions are fed codes and emit codes) unless its config names one: EnCodec 24
# kHz's, 320 samples (13.3 ms). An engine with a codec takes the codec's (`EngineConfig.take_frame_size`).
CODES_ONLY_FRAME_SIZE = 320


@dataclass
class EngineConfig:
    cache_mode: str = "radix"
    page_size: int = 16
    kv_budget_bytes: int | None = None
    num_pages: int | None = 4096  # used when kv_budget_bytes is None
    max_conversations: int = 32
    max_context: int = 2250  # steps a step attends to besides its sink (30 s: `ContextBound`); bounds its pages
    frame_size: int | None = None  # samples a frame (24 kHz): the engine's codec's, filled in by `take_frame_size`
    frames_per_tick: int = 1  # duplex steps per conversation per tick: the codec works on chunks this long
    prefill_budget: int = 256  # prefill steps per tick, all conversations together
    background_budget: int = 16  # of those, for work nobody waits on, in a tick someone waits on (`Scheduler`)
    jitter_buffer_s: float | None = None  # default: 80 ms + one tick (`_default_jitter_buffer`)
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
        if self.frame_size is not None and self.frame_size < 1:
            raise ValueError(f"frame_size must be >= 1 sample, got {self.frame_size}")
        if min(self.session_ttl_s, self.resumable_conversations, self.resumable_bytes) < 0:
            raise ValueError(
                "session_ttl_s, resumable_conversations and resumable_bytes must be >= 0, got "
                f"{self.session_ttl_s}, {self.resumable_conversations} and {self.resumable_bytes}"
            )
        self._default_jitter_buffer()

    def take_frame_size(self, codec_frame_size: int | None) -> None:
        """The engine's frame: its codec's (`codec_frame_size`), or for a codec-free engine (None) the one this config
        names, else `CODES_ONLY_FRAME_SIZE`; the default jitter buffer follows. A ValueError if this config names
        another than the codec's."""
        if codec_frame_size is None:
            codec_frame_size = self.frame_size or CODES_ONLY_FRAME_SIZE
        elif self.frame_size not in (None, codec_frame_size):
            raise ValueError(f"the config says {self.frame_size} samples a frame, the codec {codec_frame_size}")
        self.frame_size = codec_frame_size
        self._default_jitter_buffer()

    def _default_jitter_buffer(self) -> None:
        """80 ms (clients send 80 ms blocks) and a tick, once the frame is known."""
        if self.frame_size is not None and self.jitter_buffer_s is None:
            self.jitter_buffer_s = 0.08 + self.tick_s

    @property
    def frame_s(self) -> float:
        """One frame's duration; the frame size must be known (`take_frame_size`)."""
        if self.frame_size is None:
            raise ValueError("the frame size is the codec's: not known before the engine has its codec")
        return self.frame_size / SAMPLE_RATE

    @property
    def tick_s(self) -> float:
        return self.frames_per_tick * self.frame_s
