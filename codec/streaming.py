"""Stateful, chunk-invariant streaming of a codec's encoder and decoder: EnCodec's SEANet, and Mimi's (`codec/mimi/`).

Each layer is a step `layer(x, state) -> (y, new_state)` (`codec/stream_layers.py`), pure but for Mimi's
transformers, which write their new keys and values into the state they are given (`_RowStates`). `state=None` starts
a stream: the layer pads its left edge exactly as the offline model does. After that the state carries what the next
chunk needs and nothing is recomputed: a convolution keeps its last `padding` inputs, a transposed convolution the
overlap it has not emitted yet, EnCodec's LSTM its (h, c), Mimi's transformers their keys and values. States are
tuples of tensors whose first dimension is the batch row, so many conversations share one batched call
(`gather_rows` / `scatter_rows`).

EnCodec (transformers) pads the left edge of every convolution by reflection, so the first frames of a stream depend
on a few frames after them (6 frames at the latent rate, from the kernel-7 convolution there); Mimi pads with zeros,
and looks ahead by nothing (`warmup_frames` 1). `StreamingEncoder` holds its first codes back until `warmup_frames`
frames are in; `StreamingDecoder` emits at once and, until it has seen `warmup_frames` frames, decodes the row's
short history from a fresh state each push, so that every sample it emits equals `decode()` of the codes known at
that moment, and from frame `warmup_frames - 1` on equals `decode()` of the whole sequence.

Equal up to rounding, not bitwise: a row's convolutions (oneDNN) and LSTM matmuls sum in orders that depend on how
many rows and frames share the call. Measured: encoder latents and decoder PCM differ by ~2e-7 between one push and
one-frame pushes, and beside other rows (the row index alone changes nothing); the codes rarely, at quantizer ties.
With `batch_invariant=True` each row is computed alone, one frame a call (the encoder's first call takes its
`warmup_frames`), so a row's codes and PCM are the same bits whatever its chunking, its row index and the rows
pushed with it. That costs ~2.5 ms a frame and direction on one core, against ~0.6 for 8 rows of 4 frames a call.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from codec.stream_layers import State, Step


class StreamingCodec(Protocol):
    """What streaming takes of a tokenizer (`codec.tokenizer.EncodecTokenizer`, `codec.mimi.MimiTokenizer`): its nets
    as steps (`net(x, state) -> (y, new_state)`, chunks of whole frames), its quantizer, and its input checks."""

    frame_size: int
    num_codebooks: int
    encoder_warmup_frames: int  # frames the encoder's left edge looks ahead
    decoder_warmup_frames: int  # ... and the decoder's
    encoder_net: Step
    decoder_net: Step

    @property
    def device(self) -> torch.device: ...

    def check_pcm_rows(
        self, pcm: torch.Tensor | np.ndarray | Sequence, sample_rate: int | None = None
    ) -> list[np.ndarray]: ...

    def check_codes(self, codes: torch.Tensor | np.ndarray) -> torch.Tensor: ...

    def quantize(self, latent: torch.Tensor) -> torch.Tensor: ...

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor: ...


def gather_rows(state: State, idx: torch.Tensor) -> State:
    if isinstance(state, torch.Tensor):
        return state.index_select(0, idx)
    return tuple(gather_rows(s, idx) for s in state)


def scatter_rows(dst: State, idx: torch.Tensor, src: State) -> None:
    if isinstance(dst, torch.Tensor):
        dst.index_copy_(0, idx, src)
        return
    for d, s in zip(dst, src, strict=True):
        scatter_rows(d, idx, s)


def empty_like_rows(state: State, rows: int) -> State:
    if isinstance(state, torch.Tensor):
        return state.new_zeros((rows, *state.shape[1:]))
    return tuple(empty_like_rows(s, rows) for s in state)


def narrow_rows(state: State, start: int, length: int) -> State:
    """Rows `start ... start + length - 1` of `state`, as views."""
    if isinstance(state, torch.Tensor):
        return state.narrow(0, start, length)
    return tuple(narrow_rows(s, start, length) for s in state)


def copy_rows(dst: State, src: State) -> None:
    """`dst[...] = src`, leaf by leaf, but for a leaf that already is `dst`'s memory (a step updated it in place)."""
    if isinstance(dst, torch.Tensor):
        if src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride():
            dst.copy_(src)
        return
    for d, s in zip(dst, src, strict=True):
        copy_rows(d, s)


class _RowStates:
    """The carried state of `batch_size` rows, allocated on first use (its shapes come from the first run).

    Consecutive rows (the usual push: all of them) are handed to the step as views of the state, which a step may
    update in place (Mimi's transformers write their new keys and values into their cache); other rows are gathered
    into a copy and scattered back."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.state: State | None = None

    def get(self, rows: list[int], device: torch.device) -> State:
        assert self.state is not None
        if _consecutive(rows):
            return narrow_rows(self.state, rows[0], len(rows))
        return gather_rows(self.state, torch.tensor(rows, device=device))

    def use(self, buffer: State) -> None:
        """Keep the rows' state in `buffer` (a `CodecGraphs`'), from before the first push."""
        if self.state is not None:
            raise ValueError("a codec's graphs come before its first push")
        self.state = buffer

    def put(self, rows: list[int], new: State, device: torch.device) -> None:
        if self.state is None:
            self.state = empty_like_rows(new, self.batch_size)
        if _consecutive(rows):
            copy_rows(narrow_rows(self.state, rows[0], len(rows)), new)
        else:
            scatter_rows(self.state, torch.tensor(rows, device=device), new)


def _consecutive(rows: list[int]) -> bool:
    return rows == list(range(rows[0], rows[0] + len(rows)))


def _check_rows(rows: Sequence[int] | None, n: int, batch_size: int) -> list[int]:
    rows = list(range(batch_size)) if rows is None else [int(r) for r in rows]
    if len(rows) != n:
        raise ValueError(f"got {n} rows of input for {len(rows)} row indices")
    if len(set(rows)) != len(rows):
        raise ValueError(f"row indices repeat: {rows}")
    bad = [r for r in rows if not 0 <= r < batch_size]
    if bad:
        raise ValueError(f"row indices {bad} out of range for batch size {batch_size}")
    return rows


class StreamingEncoder:
    """PCM in, codes out, for `batch_size` independent rows (conversations) in one batched call.

    `push(pcm, rows)` takes, for each listed row, any number of new samples and returns, for each, the codes of the
    frames that became complete: a LongTensor [K, f] on the host (f may be 0). Codes equal `EncodecTokenizer.encode()`
    of the whole signal, but for floating-point ties in the quantizer. A row's first codes come out once `warmup_frames`
    frames are in (the reflection padding at the start of the signal looks that far ahead); after that each frame's
    codes come out as its 320th sample arrives. `batch_invariant`: see the module docstring.
    """

    def __init__(self, tokenizer: StreamingCodec, batch_size: int, batch_invariant: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tok = tokenizer
        self.batch_size = batch_size
        self.batch_invariant = batch_invariant
        self.warmup_frames = tokenizer.encoder_warmup_frames
        self._pending = [np.zeros(0, np.float32) for _ in range(batch_size)]  # on the host: a row's work is Python
        self._started = [False] * batch_size
        self._states = _RowStates(batch_size)
        self.graphs = None  # on a GPU, the engine's `CodecGraphs` for a started row's usual push (`use_graphs`)

    def reset(self, row: int) -> None:
        _check_rows([row], 1, self.batch_size)
        self._pending[row] = self._pending[row][:0]
        self._started[row] = False

    def use_graphs(self, graphs) -> None:
        """Steady pushes through `graphs` (`s2s.runner.codec_graphs.CodecGraphs`), whose buffer holds their state."""
        self._states.use(graphs.use_rows(self.batch_size))
        self.graphs = graphs

    @torch.inference_mode()
    def push(
        self, pcm: torch.Tensor | Sequence, rows: Sequence[int] | None = None, sample_rate: int | None = None
    ) -> list[torch.Tensor]:
        chunks = self.tok.check_pcm_rows(pcm, sample_rate)
        rows = _check_rows(rows, len(chunks), self.batch_size)
        if not self.batch_invariant:
            return self._push(chunks, rows)
        fs = self.tok.frame_size
        out = []
        for r, chunk in zip(rows, chunks, strict=True):  # pieces that each complete at most one frame
            cuts = range(-len(self._pending[r]) % fs or fs, len(chunk), fs)
            out.append(torch.cat([self._push([p], [r])[0] for p in np.split(chunk, list(cuts))], -1))
        return out

    def _push(self, chunks: list[np.ndarray], rows: list[int]) -> list[torch.Tensor]:
        """Each group of rows at the same point goes to the device in one copy and its codes come back in one: the
        device work of a push does not grow with its rows."""
        fs = self.tok.frame_size
        groups: dict[tuple[bool, int], list[int]] = defaultdict(list)
        for r, chunk in zip(rows, chunks, strict=True):
            self._pending[r] = np.concatenate([self._pending[r], chunk])
            ready = len(self._pending[r]) // fs
            if ready and (self._started[r] or ready >= self.warmup_frames):
                groups[(self._started[r], ready)].append(r)

        none = torch.zeros(self.tok.num_codebooks, 0, dtype=torch.long)
        out = dict.fromkeys(rows, none)
        for (started, ready), group in groups.items():
            n = ready * fs
            x = torch.from_numpy(np.stack([self._pending[r][:n] for r in group])[:, None, :]).to(self.tok.device)
            if started and self.graphs is not None and self.graphs.fits(x):
                codes = self.graphs.run(x, group)  # (the rows' state read and written in the graph)
            else:
                latent, new_state = self.tok.encoder_net(x, self._states.get(group, x.device) if started else None)
                self._states.put(group, new_state, x.device)
                codes = self.tok.quantize(latent)
            codes = codes.cpu().numpy()
            for i, r in enumerate(group):
                out[r] = torch.from_numpy(codes[i])
                self._pending[r] = self._pending[r][n:]
                self._started[r] = True
        return [out[r] for r in rows]


class StreamingDecoder:
    """Codes in, PCM out, for `batch_size` independent rows (conversations) in one batched call.

    `push(codes [R, K, n], rows)` returns [R, n * 320] samples: a frame's audio comes out in the push that brings its
    codes. Until a row has `warmup_frames` frames, its few frames are decoded again from a fresh state each push (the
    start of the stream looks ahead, see the module docstring); after that only the new frames are computed.
    `batch_invariant`: see the module docstring.
    """

    def __init__(self, tokenizer: StreamingCodec, batch_size: int, batch_invariant: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tok = tokenizer
        self.batch_size = batch_size
        self.batch_invariant = batch_invariant
        self.warmup_frames = tokenizer.decoder_warmup_frames
        self._history: list[torch.Tensor] = [self._no_codes() for _ in range(batch_size)]
        self._frames = [0] * batch_size
        self._states = _RowStates(batch_size)
        self.graphs = None  # on a GPU, the engine's `CodecGraphs` for a steady row's usual push (`use_graphs`)

    def _no_codes(self) -> torch.Tensor:
        return torch.zeros(self.tok.num_codebooks, 0, dtype=torch.long, device=self.tok.device)

    def reset(self, row: int) -> None:
        _check_rows([row], 1, self.batch_size)
        self._history[row] = self._no_codes()
        self._frames[row] = 0

    def use_graphs(self, graphs) -> None:
        """Steady pushes through `graphs` (`s2s.runner.codec_graphs.CodecGraphs`), whose buffer holds their state."""
        self._states.use(graphs.use_rows(self.batch_size))
        self.graphs = graphs

    @torch.inference_mode()
    def push(self, codes: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
        codes = self.tok.check_codes(codes)
        rows = _check_rows(rows, codes.shape[0], self.batch_size)
        if not self.batch_invariant:
            return self._push(codes, rows)
        frames = range(codes.shape[-1])
        per_row = [[self._push(codes[i : i + 1, :, f : f + 1], [r])[0] for f in frames] for i, r in enumerate(rows)]
        return torch.stack([torch.cat(pcm) for pcm in per_row])

    def _push(self, codes: torch.Tensor, rows: list[int]) -> torch.Tensor:
        n = codes.shape[-1]
        fs = self.tok.frame_size
        out = torch.empty(len(rows), n * fs, device=self.tok.device)

        steady = [i for i, r in enumerate(rows) if self._frames[r] >= self.warmup_frames]
        if steady:
            group = [rows[i] for i in steady]
            x = codes[steady]
            if self.graphs is not None and self.graphs.fits(x):
                audio = self.graphs.run(x, group)  # (the rows' state read and written in the graph)
            else:
                audio, new_state = self.tok.decoder_net(self.tok.dequantize(x), self._states.get(group, codes.device))
                self._states.put(group, new_state, codes.device)
            out[steady] = audio[:, 0]

        by_length: dict[int, list[int]] = defaultdict(list)
        for i, r in enumerate(rows):
            if self._frames[r] < self.warmup_frames:
                self._history[r] = torch.cat([self._history[r], codes[i]], dim=-1)
                by_length[self._history[r].shape[-1]].append(i)
        for idx in by_length.values():
            group = [rows[i] for i in idx]
            prefix = torch.stack([self._history[r] for r in group])
            audio, new_state = self.tok.decoder_net(self.tok.dequantize(prefix), None)
            self._states.put(group, new_state, codes.device)
            out[idx] = audio[:, 0, -n * fs :]

        for r in rows:
            self._frames[r] += n
            if self._frames[r] >= self.warmup_frames and self._history[r].shape[-1]:
                self._history[r] = self._no_codes()  # once, when the row leaves its warm-up
        return out
