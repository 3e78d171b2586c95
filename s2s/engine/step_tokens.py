"""StepTokens: a session's step tokens read from its two streams of frames, and what sampling a step fills.

Step t holds codebook k of frame t - delays[k] of both streams (`pad_id` before frame 0): it is known once user
frame t - delays[k] and model frame t - delays[k] are, for every k. The forward over step t gives the logits of step
t + 1; of those, only the (frame, codebook) pairs still unknown are sampled (`wanted`, `accept`). A mixin of
`Session` (`s2s/engine/session.py`), which holds the streams; the reads a tick makes of every session are here.
"""

from __future__ import annotations

import numpy as np

from s2s.engine.frames import UNKNOWN


class StepTokens:
    __slots__ = ()  # (`Session` holds the attributes)

    def step_token(self, t: int) -> np.ndarray | None:
        """Step t's 2K codes, or None while some of them are unknown."""
        if t - self.min_delay >= len(self.user):
            return None
        token = self._tokens(t, t + 1)[0]
        return None if (token == UNKNOWN).any() else token

    def step_known(self, t: int) -> bool:
        """`step_token(t) is not None`, read code by code where its frames are recent (the engine loop asks it of
        every duplex session after every tick)."""
        if t - self.max_delay >= max(self.user.start, self.model.start):
            return self._recent_step(t) is not None
        return self.step_token(t) is not None

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        """Steps start..stop-1 as `[n, 2K]`, UNKNOWN where a code is not known (frames within the arrays)."""
        low = start - self.max_delay
        if low >= self.user.start and low >= self.model.start:  # each tick's read: recent frames, none padded
            return self.recent_tokens(start, stop)
        frames = np.arange(start, stop)[:, None] - self.delays[None, :]
        idx = np.arange(len(self.delays))[None, :]
        safe = np.maximum(frames, 0)
        user = np.where(frames < 0, self.cfg.pad_id, self.user.gather(safe, idx))
        model = np.where(frames < 0, self.cfg.pad_id, self.model.gather(safe, idx))
        return np.concatenate([user, model], axis=1)

    def recent_tokens(self, start: int, stop: int) -> np.ndarray:
        """`_tokens` of steps whose frames are all held from the streams' `start` on: a slice per codebook."""
        tokens = np.full((stop - start, 2 * len(self.delays)), UNKNOWN, dtype=np.int64)
        for base, stream in ((0, self.user), (len(self.delays), self.model)):
            data, first = stream.data, start - stream.start
            if first - self.max_delay < 0:
                raise IndexError(f"step {start} reads frames before the recent ones ({stream.start} on)")
            for k, d in self.codebook_delays:
                codes = data[first - d : first - d + stop - start, k]
                tokens[: len(codes), base + k] = codes
        return tokens

    def _recent_step(self, t: int) -> list[int] | None:
        """Step t's 2K codes read one by one, or None at the first unknown (the model's first: a decode round waits on
        those). Its frames must all be from the streams' `start` on. A known step is one `ready_steps` may return
        alone whatever its bounds: the step count, the arrays' end, a chunk's pages and a gap's all stop after it."""
        codes = [0] * (2 * len(self.delays))
        for base, stream in ((len(self.delays), self.model), (0, self.user)):
            data, start = stream.data, stream.start
            for k, d in self.codebook_delays:
                row = t - d - start
                if row >= len(data) or (code := int(data[row, k])) == UNKNOWN:
                    return None
                codes[base + k] = code
        return codes

    def _steps_in_arrays(self) -> int:
        """Steps from this one on need a frame beyond the stream arrays: none of them is known."""
        return max(0, len(self.user) + self.min_delay)

    @staticmethod
    def _known_run(tokens: np.ndarray) -> np.ndarray:
        """The leading rows of `tokens` with every code known."""
        unknown = np.flatnonzero((tokens == UNKNOWN).any(axis=1))
        return tokens[: unknown[0]] if len(unknown) else tokens

    def known_key(self) -> np.ndarray:
        """The prefix key of every step known so far (contiguous from 0): what a prefix-cache match looks up. Past
        a gap in its pages, only its sink's steps: no cached prefix can be what it has after the gap."""
        if self.dropped:
            return self._tokens(0, self.sink * self.bound.page_size)
        return self._known_run(self._tokens(0, self._steps_in_arrays()))

    def ready_steps(self, limit: int) -> np.ndarray:
        """Up to `limit` known steps from `computed` on, as `[n, 2K]` (n may be 0): steps of one chunk, which all
        see the same pages (`ContextBound.chunk_stop`), and none past the sink when the pages after it have a gap."""
        t = self.computed
        if limit >= 1 and t - self.max_delay >= max(self.user.start, self.model.start):  # a decode round's usual read
            if (step := self._recent_step(t)) is None:
                return np.empty((0, 2 * len(self.delays)), dtype=np.int64)
            if self._recent_step(t + 1) is None:  # one step: within every bound (see `_recent_step`)
                return np.array([step], dtype=np.int64)
        stop = min(self.computed + limit, max(self.computed, self._steps_in_arrays()))
        if self.bound is not None:
            stop = min(stop, self.bound.chunk_stop(self.sink, self.computed))
            if self.dropped and self.computed < self.sink * self.bound.page_size:
                stop = min(stop, self.sink * self.bound.page_size)
        return self._known_run(self._tokens(self.computed, stop))

    def key(self, steps: int) -> np.ndarray:
        """The prefix key: step tokens 0..steps-1 (all known)."""
        key = self._tokens(0, steps)
        if (known := len(self._known_run(key))) < steps:
            raise ValueError(f"step {known} of the key is not known")
        return key

    def wanted(self) -> list[tuple[int, int]]:
        """(frame, codebook) pairs that sampling the logits of step `computed` would fill: those still unknown."""
        return self.wanted_after(0)

    def wanted_after(self, steps: int) -> list[tuple[int, int]]:
        """What sampling would fill once `steps` more steps are computed."""
        t, model = self.computed + steps, self.model
        end, start, data, out = len(model), model.start, model.data, []
        for k, d in self.codebook_delays:
            f = t - d
            if f >= start:  # the usual read: a recent frame
                if f >= end or data[f - start, k] != UNKNOWN:
                    continue
            elif f < 0 or model.forgotten(f) or model.code(f, k) != UNKNOWN:  # (forgotten frames were all known)
                continue
            if self._predicted(f):
                out.append((f, k))
        return out

    def _predicted(self, frame: int) -> bool:
        if self.mode == "duplex":
            return frame >= 1 and frame >= self.prompt_frames
        turn = self.turns[-1] if self.turns else None
        return (
            turn is not None
            and turn.reply_start is not None
            and frame >= turn.reply_start
            and (turn.reply_end is None or frame < turn.reply_end)
        )

    def accept(self, codes: np.ndarray, wanted: list[tuple[int, int]]) -> None:
        """Fill the `wanted()` (frame, codebook) pairs from sampled step codes `[K]`."""
        self._ensure(self.computed + 2)
        model = self.model
        for f, k in wanted:
            if f >= model.start:
                model.data[f - model.start, k] = codes[k]
            else:
                model[f, k] = codes[k]
