"""A Moshi model's text stream as text: its sentencepiece pieces, padding left out, as Kyutai's server sends them."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class TextPieces:
    """Text ids -> text: `piece(id)` with sentencepiece's word marker as a space; the model's padding ids (Kyutai's
    `existing_text_padding_id` and end-of-padding id 0, which fill the steps between words) give nothing."""

    def __init__(self, path: str | Path, padding_ids: tuple[int, ...]):
        """`padding_ids`: the model's text padding id (what its text says between words), then any others."""
        import sentencepiece

        self.path = Path(path)
        self.processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.padding_id = padding_ids[0]
        self.padding_ids = frozenset(padding_ids)

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size()

    def text(self, ids: np.ndarray | list[int]) -> str:
        """The text of a run of text ids (one per frame)."""
        pieces = (self.processor.id_to_piece(int(i)) for i in ids if int(i) not in self.padding_ids)
        return "".join(pieces).replace("\u2581", " ")
