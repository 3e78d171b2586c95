"""CodecGraphs: the streaming codec's steady push (the encoder's PCM to codes, the decoder's codes to PCM, each row
from its carried state) replayed from CUDA graphs, one per batch bucket and push length, for either codec (EnCodec,
Mimi: `codec.Tokenizer`).

The codec's nets are dozens of small convolutions and an LSTM (EnCodec) or two small transformers (Mimi): on a GPU,
launches at every tick as the model's were (`s2s/runner/cuda_graphs.py`). A steady push of a given length has fixed
shapes whatever the rows, so, as for the decode step, each bucket size and length is captured once over static
buffers (the input, at the longest length, and the rows' indices) in one memory pool. The rows' carried state lives
in this object's buffer (the streaming codec's, once it `use_graphs`), which the graph gathers from and scatters
back to by the indices: a push is two copies in and a replay. Rows past the real batch are padding, which read and
write a spare row of the state; the codec's rows never mix, and their output is dropped. A push of another length,
or a row still in its warm-up (`codec/streaming.py`), runs eagerly, on the same buffer.

Every tensor a step carries from one push to the next is in that buffer, its shape the same at every push: Mimi's
transformers keep each row's position and, per layer, a ring of keys and values over their context (`context - 1`
steps), which the step writes into in place. Here it writes into the gathered copy, which the scatter puts back, so
a replay leaves each row's ring and position where the eager step would. The decoder's pushes are the engine's own
(a tick's frames); the encoder's are the clients' (Moshi's client sends 80 ms: 6 of EnCodec's frames, 1 of Mimi's),
so it is captured for every length up to twice a tick's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from codec import Tokenizer
from codec.stream_layers import State
from codec.streaming import empty_like_rows, gather_rows, scatter_rows
from s2s.runner.cuda_graphs import bucket_sizes, capture

Step = Callable[[torch.Tensor, State], tuple[torch.Tensor, State]]


class CodecGraphs:
    """`step(x, state) -> (y, new_state)` over up to `rows` rows of input `[R, ..., L]` for each length L of
    `lengths`, each row's input shaped as `one_row`'s (`[1, ..., any]`) and its state as `one_state`'s; with
    `capture=False` the same static buffers and padding run eagerly (the CPU path of the tests: everything here but
    the capture itself)."""

    def __init__(
        self,
        step: Step,
        one_row: torch.Tensor,
        lengths: list[int],
        one_state: State,
        rows: int,
        capture: bool = True,
    ):
        if capture and one_row.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {one_row.device}")
        self.step, self.capture, self.lengths, self.rows = step, capture, sorted(lengths), rows
        self.sizes = bucket_sizes(rows)
        self.input = one_row.new_zeros((self.sizes[-1], *one_row.shape[1:-1], self.lengths[-1]))
        self.row_state = empty_like_rows(one_state, rows + 1)  # each row's carried state, then the spare row
        self.index = torch.full((self.sizes[-1],), rows, dtype=torch.long, device=one_row.device)  # (all spare)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        if capture:
            self._capture_all()

    @classmethod
    def encoder(cls, tok: Tokenizer, rows: int, frames: list[int], capture: bool = True) -> CodecGraphs:
        """PCM `[R, 1, n x frame_size]` to codes `[R, K, n]`, for each n of `frames`."""

        def step(pcm: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
            latent, new_state = tok.encoder_net(pcm, state)
            return tok.quantize(latent), new_state

        with torch.inference_mode():
            pcm = torch.zeros(1, 1, tok.encoder_warmup_frames * tok.frame_size, device=tok.device)
            _, state = tok.encoder_net(pcm, None)
        return cls(step, pcm, [n * tok.frame_size for n in frames], state, rows, capture)

    @classmethod
    def decoder(cls, tok: Tokenizer, rows: int, frames: list[int], capture: bool = True) -> CodecGraphs:
        """Codes `[R, K, n]` to PCM `[R, 1, n x frame_size]`, for each n of `frames`."""

        def step(codes: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
            return tok.decoder_net(tok.dequantize(codes), state)

        with torch.inference_mode():
            codes = torch.zeros(1, tok.num_codebooks, tok.decoder_warmup_frames, dtype=torch.long, device=tok.device)
            _, state = step(codes, None)
        return cls(step, codes, frames, state, rows, capture)

    def use_rows(self, batch_size: int) -> State:
        """The rows' state buffer, for a streaming codec of `batch_size` rows to keep its state in."""
        if batch_size != self.rows:
            raise ValueError(f"graphs for {self.rows} rows, not {batch_size}")
        return self.row_state

    def _step(self, length: int, size: int) -> torch.Tensor:
        index = self.index[:size]
        y, new_state = self.step(self.input[:size, ..., :length], gather_rows(self.row_state, index))
        scatter_rows(self.row_state, index, new_state)
        return y

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Every index is the spare row's meanwhile."""
        keys = [(length, size) for length in self.lengths[::-1] for size in self.sizes[::-1]]
        self.graphs, self.outputs = capture(self.input.device, keys, lambda key: self._step(*key))

    def fits(self, x: torch.Tensor) -> bool:
        return len(x) <= self.sizes[-1] and x.shape[1:-1] == self.input.shape[1:-1] and x.shape[-1] in self.lengths

    def run(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """`step` for `rows` (distinct, each below `self.rows`), their input `x`, from their state in `row_state`,
        which it then holds their new state. The output is a view of the graph's buffer, which the next run
        overwrites: the caller copies it out."""
        if not self.fits(x) or len(rows) != len(x):
            shape = [*self.input.shape[1:-1], self.lengths]
            raise ValueError(f"{list(x.shape)} for {len(rows)} rows is not up to {self.sizes[-1]} rows of {shape}")
        n, length = len(x), x.shape[-1]
        size = next(s for s in self.sizes if s >= n)
        index = np.full(size, self.rows, dtype=np.int64)  # padding: the spare row
        index[:n] = rows
        self.input[:n, ..., :length].copy_(x)
        self.index[:size].copy_(torch.from_numpy(index))
        if self.capture:
            self.graphs[length, size].replay()
            return self.outputs[length, size][:n]
        return self._step(length, size)[:n]


def codec_graphs(tok: Tokenizer, rows: int, tick_frames: int, capture: bool = True) -> tuple[CodecGraphs, CodecGraphs]:
    """The encoder's graphs, for pushes of 1 to twice `tick_frames` frames, and the decoder's, for a tick's."""
    encoder = CodecGraphs.encoder(tok, rows, list(range(1, 2 * tick_frames + 1)), capture)
    return encoder, CodecGraphs.decoder(tok, rows, [tick_frames], capture)
