"""The speech this machine makes and hears (`speech/`): voices, training text, augmentation and the oracle itself.

The oracle must hear the clean held-out originals, and must not hear noise or a different sentence as one."""

import random

import numpy as np
import pytest

from speech import oracle
from speech.corpus import augment
from speech.recognizer import Recognizer
from speech.sentences import HELDOUT_SENTENCES, training_sentences
from speech.voices import HELDOUT_VOICES, TRAIN_VOICES, Voice, say


def test_held_out_voices_and_sentences_are_not_trained_on() -> None:
    assert not set(HELDOUT_VOICES) & set(TRAIN_VOICES)
    assert not {v.name for v in HELDOUT_VOICES} & {v.name for v in TRAIN_VOICES}
    assert not set(training_sentences(2000, seed=0)) & set(HELDOUT_SENTENCES)


@pytest.mark.parametrize("voice", [Voice("espeak", "en-us+m3"), Voice("flite", "slt"), TRAIN_VOICES[-1]])
def test_every_engine_speaks_at_24_khz(voice: Voice) -> None:
    pcm = say("a short test", voice)
    assert pcm.dtype == np.float32 and 0.3 * 24000 < len(pcm) < 3 * 24000
    assert 0.5 < np.abs(pcm).max() <= 0.9 + 1e-6


def test_augment_keeps_speech_in_range() -> None:
    pcm = say("a short test", TRAIN_VOICES[0])
    out = augment(pcm, random.Random(3))
    assert out.dtype == np.float32 and np.abs(out).max() <= 1.0 and 0.5 < len(out) / len(pcm) < 1.5


def test_the_oracle_hears_the_originals_and_nothing_else() -> None:
    """Clean held-out takes are heard as their sentences; noise, silence and sentences outside the set are heard
    as none of them."""
    takes = oracle.takes(20)
    assert oracle.rate(takes, [t.pcm for t in takes]) >= 0.9
    hear = oracle.recognizer()
    assert hear.identify(np.random.default_rng(0).normal(0, 0.1, 48000).astype(np.float32)) is None
    assert hear.identify(np.zeros(48000, np.float32)) is None
    assert hear.identify(say("where is the nearest train station", HELDOUT_VOICES[0])) is None


def test_a_sentence_with_unknown_words_is_refused() -> None:
    with pytest.raises(ValueError, match="dictionary lacks"):
        Recognizer(["the qzxv is here"])
