"""PagedStep: a round's forward over the paged K/V pool, the same for every model family: embed the step tokens at
their positions, run the backbone over the pages, and turn each sequence's last hidden state into what its `head`
samples from (`step_state`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from s2s.runner.batch import PagedBatch


@dataclass
class StepOutput:
    state: torch.Tensor  # each sequence's last new step's: what the model's `head` samples the next step from


class PagedStep:
    """A mixin for a model with `embed(tokens, positions)`, `backbone` and `step_state(hidden, batch_invariant)`."""

    def forward_paged(
        self,
        tokens: torch.Tensor,
        batch: PagedBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        batch_invariant: bool = False,
    ) -> StepOutput:
        """Flattened step tokens `[N, 2K]` of a PagedBatch -> each sequence's state for its next step; every step's
        K/V goes into its pages.

        `batch_invariant=True` (CPU, fp32): the K/V each step stores and the state of each sequence's last step are
        bitwise the same whatever else is in the batch, the step's position in it, and the chunks its sequence was
        computed in (one step at a time, one chunk, several), at a fixed thread count. Slower; see
        `paged_kernels/batch_invariant.py`.
        """
        if tokens.shape[0] != batch.positions.shape[0]:
            raise ValueError(f"{tokens.shape[0]} tokens for a batch of {batch.positions.shape[0]}")
        x = self.embed(tokens, batch.rope_positions)
        hidden = self.backbone.forward_paged(x, batch, k_caches, v_caches, batch_invariant)
        return StepOutput(self.step_state(hidden[batch.cu_seqlens_q[1:].long() - 1], batch_invariant))
