"""AudioIO: every session's new user audio through one batched encoder call, every session's newly complete model
frames through one batched decoder call per chunk length, and the send accounting (duplex frame deadlines).

Without a codec (a codec-free engine, e.g. a text model over one codebook of bytes) sessions are fed codes and emit
`CodesEvent`s: both directions pass codes through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import repeat

import numpy as np
import torch

from codec import Tokenizer
from s2s.engine.events import NO_TIMES, AudioEvent, CodesEvent, made
from s2s.engine.frames import UNKNOWN, FrameRows, along_last
from s2s.engine.metrics import EngineStats
from s2s.engine.session import Session
from s2s.engine.turns import Phase, Turn
from s2s.models.config import ModelConfig
from s2s.runner.codec_graphs import codec_graphs
from s2s.scheduling.scheduler import first_audio_due, frame_deadline


class AudioIO:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        rows: int,
        user_frames: FrameRows,
        model_frames: FrameRows,
        layout: ModelConfig,
        frame_s: float,
        jitter_buffer_s: float,
        stats: EngineStats,
        clock: Callable[[], float],
        batch_invariant: bool,
        graph_frames: int | None,
    ):
        """`user_frames`, `model_frames`: every live session's recent frames, which new user frames are written into
        and the decoder reads; `layout`: the model's step layout (with a text stream, the codec's codes are a
        frame's codebooks 1 on, and the user's text slot is `pad_id`); `frame_s`: a frame's duration (what the
        deadlines count in); `batch_invariant`: the codec computes each row alone, a frame a call
        (`codec/streaming.py`); `graph_frames`: a tick's frames: with
        the codec on a GPU, the decoder's steady pushes of that many frames and the encoder's of up to twice as many
        replay from CUDA graphs (`CodecGraphs`)."""
        self.encoder = tokenizer.streaming_encoder(rows, batch_invariant) if tokenizer else None
        self.decoder = tokenizer.streaming_decoder(rows, batch_invariant) if tokenizer else None
        if tokenizer is not None and graph_frames and tokenizer.device.type == "cuda" and not batch_invariant:
            encoder, decoder = codec_graphs(tokenizer, rows, graph_frames)
            self.encoder.use_graphs(encoder)
            self.decoder.use_graphs(decoder)
        self.user_frames, self.model_frames = user_frames, model_frames
        self.codebook_size, self.stats, self.clock = layout.codebook_size, stats, clock
        self.layout, self.text_stream = layout, layout.text_stream
        # Moshi's frame 0 is its initial token, never spoken (Kyutai's server sends frames from 1 on)
        self.first_sent = 1 if layout.text_stream else 0
        self.frame_s, self.jitter_buffer_s = frame_s, jitter_buffer_s
        if tokenizer is not None:
            silence = tokenizer.encode(np.zeros(tokenizer.frame_size * 16, dtype=np.float32))[0, :, -1:]
            self.silence_codes = self.layout.as_frames(silence.cpu().numpy())[
                :, 0
            ]  # what the codec makes of digital silence

    def reset(self, row: int) -> None:
        """A row's codec state back to the start of a stream (a new session, or a reply cut short)."""
        if self.encoder is not None:
            self.encoder.reset(row)
            self.decoder.reset(row)

    def reset_decoder(self, row: int) -> None:
        if self.decoder is not None:
            self.decoder.reset(row)

    def encode(self, sessions: Iterable[Session]) -> None:
        """Each session's pushed input becomes user frames (`Session.hear`): PCM through the streaming encoder, all
        sessions in one call; codes as they are."""
        rows, chunks, owners, heard = [], [], [], []
        for s in sessions:
            if not s.pending:
                continue
            taken, s.pending = s.pending, []
            if s.input_kind == "codes":
                heard.append((s, taken[0] if len(taken) == 1 else np.concatenate(taken, axis=1)))
            else:
                rows.append(s.row)
                chunks.append(np.concatenate(taken))
                owners.append(s)
        if rows:
            encoded = zip(owners, (c.numpy() for c in self.encoder.push(chunks, rows)), strict=True)
            heard += [(s, self.layout.as_frames(codes)) for s, codes in encoded if codes.shape[-1]]
        now = self.clock()
        duplex: dict[int, list[tuple[Session, np.ndarray]]] = {}  # by frame count
        for s, codes in heard:
            if s.mode == "duplex":
                duplex.setdefault(codes.shape[1], []).append((s, codes))
            else:
                s.hear(codes, now)
        for n, items in duplex.items():
            self._hear_duplex(n, items, now)

    def _hear_duplex(self, n: int, items: list[tuple[Session, np.ndarray]], now: float) -> None:
        """`Session.hear` of duplex sessions' `n` new frames each, written into their rows at once; one whose frames
        are not in the rows, or would not fit in them, hears them on its own (its frames then leave the rows)."""
        rows = np.array([s.row for s, _ in items], dtype=np.int64)
        user_start, model_start = self.user_frames.start[rows], self.model_frames.start[rows]
        heard = np.array([s.user_frames for s, _ in items], dtype=np.int64)
        fits = heard + n + 1 - np.minimum(user_start, model_start) <= self.user_frames.limit
        fits &= self.user_frames.holding[rows] & self.model_frames.holding[rows]
        if not fits.all():
            for i in np.flatnonzero(~fits).tolist():
                items[i][0].hear(items[i][1], now)
            keep = np.flatnonzero(fits)
            items = [items[i] for i in keep.tolist()]
            rows, user_start, model_start, heard = rows[keep], user_start[keep], model_start[keep], heard[keep]
            if not items:
                return
        offsets = heard - user_start
        if offsets.min() < 0:
            raise AssertionError("a duplex session's next user frame is before its recent frames")
        self.user_frames.room(rows, offsets + n + 1)  # (as `Session._ensure`)
        self.model_frames.room(rows, heard + n + 1 - model_start)
        codes = np.concatenate([c for _, c in items], axis=1)  # [K, n x frames]: (np.stack costs 3x as much)
        codes = codes.reshape(len(codes), len(items), n).transpose(1, 2, 0)
        self.user_frames.write(rows, offsets[:, None] + np.arange(n), codes)
        Session.heard_in_rows([s for s, _ in items], n, now)

    def decode(self, sessions: Iterable[Session], first_audio_only: bool = False) -> None:
        """Decode and send every session's newly complete frames (one decoder call per chunk length).
        `first_audio_only`: only turns whose reply has its first frame complete and nothing sent yet; the rest of
        the tick's rounds would otherwise delay that first audio (the user is waiting on it)."""
        sessions = [s for s in sessions if first_audio_due(s)] if first_audio_only else list(sessions)
        if not sessions:
            return
        row = np.array([s.row for s in sessions], dtype=np.int64)
        model_start = self.model_frames.start[row]  # (where it is in the rows)
        model_row = np.where(self.model_frames.holding[row], row, -1)  # -1: not in the rows
        prompt = np.array([s.prompt_frames for s in sessions], dtype=np.int64)
        arrived = np.array([s.first_frame_at for s in sessions], dtype=np.float64)  # NaN: no user frame yet
        duplex = np.array([s.mode == "duplex" for s in sessions])
        complete = self._complete(sessions, model_start, model_row)
        starts, stops = self._sendable(
            sessions, complete, np.maximum(prompt, self.first_sent), duplex, ~np.isnan(arrived)
        )
        todo = np.flatnonzero(stops > starts)
        lengths = (stops - starts)[todo]
        for length in np.unique(lengths).tolist():
            picked = todo[lengths == length]
            items, first = [sessions[i] for i in picked.tolist()], starts[picked]
            codes = self._frames_to_send(items, first, model_row[picked], first - model_start[picked], length)
            if self.decoder is None:
                out = codes  # codec-free: the sampled ids themselves
            else:
                text = codes[:, 0] if self.text_stream else repeat(None, len(items))  # (ids past the audio's)
                codes = np.where(codes < self.codebook_size, codes, self.silence_codes[None, :, None])
                audio = codes[:, 1:] if self.text_stream else codes
                out = self.decoder.push(torch.from_numpy(audio), [s.row for s in items]).cpu().numpy()
            now, starts_at = self.clock(), first.tolist()
            turns = [s.turns[-1] for s in items]
            times = [NO_TIMES if "first_audio_out" in t.times else _first_audio(t, now) for t in turns]
            ids, turn_ids = [s.id for s in items], [t.id for t in turns]
            fields = [ids, turn_ids, starts_at, out, times]
            if self.decoder is not None:  # (an AudioEvent's text: its frames' text ids, with a text stream)
                fields.append(text)
            events = made(AudioEvent if self.decoder is not None else CodesEvent, *fields)
            for s, a, event in zip(items, starts_at, events, strict=True):
                s.emitted = a + length
                s.events.put(event, length)
            late = self._late(arrived[picked], first - prompt[picked], length, now) * duplex[picked]
            for i in np.flatnonzero(late).tolist():
                items[i].deadline_misses += int(late[i])
            self.stats.deadline_misses += int(late.sum())

    @staticmethod
    def _sendable(
        sessions: list[Session], complete: np.ndarray, prompt: np.ndarray, duplex: np.ndarray, heard: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each session's model frames to send now, `starts[i]..stops[i]-1`: duplex, every complete frame after the
        voice prompt once its user's first frame is in; turn mode, the reply's complete frames."""
        emitted = np.array([s.emitted for s in sessions], dtype=np.int64)
        starts = np.where(duplex, np.maximum(emitted, prompt), emitted)
        stops = np.where(heard, complete, starts)
        for i in np.flatnonzero(~duplex).tolist():
            s = sessions[i]
            if s.phase is not Phase.REPLY:
                stops[i] = s.emitted
                continue
            turn = s.turns[-1]
            stop = complete[i] if turn.reply_end is None else min(complete[i], turn.reply_end)
            stops[i] = max(s.emitted, stop)
        return starts, stops

    def _complete(self, sessions: list[Session], model_start: np.ndarray, model_row: np.ndarray) -> np.ndarray:
        """`Session.complete_model_frames` of each: the frame it counts up to is read for all at once in the rows,
        and only a session whose count moves on (or whose frames are not in the rows) counts on its own."""
        complete = np.array([s.complete for s in sessions], dtype=np.int64)
        at = complete - model_start
        in_rows = (model_row >= 0) & (at >= 0)
        check = np.flatnonzero(in_rows & (at < self.model_frames.held(model_row)))
        moves = along_last(np.logical_and, self.model_frames.read(model_row[check], at[check], 1)[:, 0] != UNKNOWN)
        for i in np.flatnonzero(~in_rows).tolist() + check[moves].tolist():
            complete[i] = sessions[i].complete_model_frames()
        return complete

    def _frames_to_send(
        self, items: list[Session], first: np.ndarray, rows: np.ndarray, offsets: np.ndarray, length: int
    ) -> np.ndarray:
        """`[n, K, length]`: each session's model frames from `first[i]` on (`offsets[i]` in its row `rows[i]`), read
        from the rows at once where they all are."""
        if (rows < 0).any():
            return np.stack([s.model[a : a + length].T for s, a in zip(items, first.tolist(), strict=True)])
        if offsets.min() < 0:
            raise IndexError("frames to send were forgotten")
        return self.model_frames.read(rows, offsets, length).transpose(0, 2, 1)

    def _late(self, arrived: np.ndarray, since: np.ndarray, length: int, now: float) -> np.ndarray:
        """How many of each one's `length` frames, from the `since[i]`-th after its voice prompt on, are sent after
        their deadline (counted from `arrived[i]`, when its user's first frame came in)."""
        frames = since + np.arange(length)[:, None]  # [length, n]: operations along the sessions
        return (now > frame_deadline(arrived, frames, self.frame_s, self.jitter_buffer_s)).sum(0)


def _first_audio(turn: Turn, now: float) -> dict[str, float]:
    """The turn's first audio goes out `now`: its stage times so far, for the event that carries it."""
    turn.times["first_audio_out"] = now
    return dict(turn.times)
