"""The shipped codec, heard by the oracle (pocketsphinx over the held-out sentences): a round trip at the default
bandwidth, offline and streaming, is recognised at no less than 90 % of the originals' rate."""

import pytest

from codec import EncodecTokenizer
from s2s.models.shipped import shipped
from speech import oracle


@pytest.fixture(scope="module")
def originals(takes, originals_rate) -> float:
    rate = originals_rate(takes)
    assert rate >= 0.9, f"the recogniser hears only {rate:.0%} of the clean originals: the oracle itself is broken"
    return rate


@pytest.mark.usefixtures("worker_threads")  # whole takes at once: more threads run it faster (not frame by frame)
def test_offline_round_trip_is_heard(takes, originals) -> None:
    tok = EncodecTokenizer.from_pretrained(shipped("codec"), bandwidth=1.5)
    rate = oracle.rate(takes, [oracle.offline_round_trip(tok, t.pcm) for t in takes])
    assert rate >= 0.9 * originals, f"round trip heard {rate:.0%}, originals {originals:.0%}"


def test_streaming_round_trip_is_heard(takes, originals) -> None:
    """Every fourth take (the streaming decoder runs frame by frame: slow on 2 cores)."""
    tok = EncodecTokenizer.from_pretrained(shipped("codec"), bandwidth=1.5)
    some = takes[::4]
    rate = oracle.rate(some, [oracle.streaming_round_trip(tok, t.pcm) for t in some])
    assert rate >= 0.9 * originals, f"streaming round trip heard {rate:.0%}, originals {originals:.0%}"


@pytest.mark.usefixtures("worker_threads")
def test_a_wrong_codec_is_not_heard(takes, originals) -> None:
    """The oracle can fail: seeded random weights make noise that it does not hear as the sentences."""
    tok = EncodecTokenizer.from_pretrained(None, bandwidth=1.5)
    some = takes[::8]
    assert oracle.rate(some, [oracle.offline_round_trip(tok, t.pcm) for t in some]) < 0.3
