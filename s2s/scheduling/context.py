"""ContextBound: what a conversation attends to, so that it can run for as long as its user talks with flat memory.

A step attends to the conversation's sink, the pages that hold its voice prompt (at least the first page: the
attention sink of StreamingLLM, which a model keeps looking at), and to a window of the most recent pages: a step
in page q sees pages `max(sink, q - window + 1) .. q` (itself and the steps before it in q). Older pages leave
attention and go back to the pool. The window is whole pages, so a step's context depends on its position alone,
never on the chunk or batch it is computed in.

Positions keep growing, as Moshi's do: K/V are stored rotated at their absolute positions and never rotated again,
so a window's steps keep their distances. The forward sees a compact page table, the sink's pages and then the
window's, and the steps' absolute positions for RoPE (`visible`).

Turn mode keeps `rewind_pages` more behind the window: a barge-in or a regenerate goes back into the last reply and
recomputes from there, which needs the window its first recomputed step saw.

A model with an attention window of its own (Moshi's `context`: a step sees the last `context` steps, and nothing
before them) has no sink (`sink=False`): its window of pages holds every step the model's window reaches, and the
compact page table keeps the steps' distances, so the attention kernel's window masks exactly what the model's does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ContextBound:
    page_size: int
    window_pages: int  # the recent window, in pages
    rewind_pages: int  # turn mode: pages kept behind the window for a rewind into the last reply
    sink: bool = True  # the prompt's pages (at least one) stay in attention; False: a model's own window, no sink

    @classmethod
    def of(
        cls, window_steps: int, page_size: int, max_reply_frames: int, max_delay: int, model_window: int | None = None
    ) -> ContextBound:
        """`model_window`: the model's own attention window in steps, which then sets the window (the pages any of
        its steps reach) in place of `window_steps`, with no sink."""
        if model_window is not None:
            window_pages = model_window_pages(model_window, page_size)
        else:
            window_pages = math.ceil(window_steps / page_size)
        rewind = math.ceil((max_reply_frames + max_delay + 2) / page_size) + 1
        return cls(page_size, window_pages, rewind, sink=model_window is None)

    def sink_pages(self, prompt_frames: int) -> int:
        if not self.sink:
            return 0
        return max(1, math.ceil(prompt_frames / self.page_size))

    def window_start(self, sink: int, page: int) -> int:
        """The first window page a step in `page` sees."""
        return max(sink, page - self.window_pages + 1)

    def chunk_stop(self, sink: int, step: int) -> int:
        """One past the last step a chunk from `step` may run to: its steps must all see the same pages."""
        page = step // self.page_size
        return (max(page, sink + self.window_pages - 1) + 1) * self.page_size

    def keep_from(self, sink: int, step: int, mode: str) -> int:
        """The first page past the sink that a conversation whose next step is `step` still needs."""
        behind = self.rewind_pages if mode == "turn" else 0
        return self.window_start(sink, step // self.page_size - behind)

    def max_pages(self, sink: int, mode: str) -> int:
        """The most pages a conversation holds: its sink, the window and what turn mode keeps behind it."""
        return sink + self.window_pages + (self.rewind_pages if mode == "turn" else 0)

    def most_seen(self, sink_pages: int) -> int:
        """The most steps a step sees: its sink's and the window's."""
        return (sink_pages + self.window_pages) * self.page_size

    def check_positions(self, sink_pages: int, limit: int) -> None:
        """What a step sees (its sink and window) stays within the `limit` positions the model was built for."""
        seen = self.most_seen(sink_pages)
        if seen > limit:
            raise ValueError(
                f"a step would see {seen} steps (a sink of {sink_pages} pages and a window of "
                f"{self.window_pages}), over the model's {limit} positions: shorten the prompt or the window"
            )


def model_window_pages(window: int, page_size: int) -> int:
    """The pages a step of a model whose own window is `window` steps reaches: its window spans one page more."""
    return math.ceil(window / page_size) + 1
