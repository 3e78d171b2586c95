"""The server's Ogg/Opus encoder against sphn, the reader Moshi's clients use, and against RFC 7845's page layout."""

import struct

import numpy as np
import pytest
import sphn

from codec.pcm import SAMPLE_RATE
from server.moshi.ogg_opus import OggOpusWriter, ogg_crc, ogg_page


def pages(stream: bytes) -> list[dict]:
    out, at = [], 0
    while at < len(stream):
        assert stream[at : at + 4] == b"OggS"
        flags, granule, serial, sequence, crc, n = struct.unpack_from("<BqIIIB", stream, at + 5)
        lacing = stream[at + 27 : at + 27 + n]
        end = at + 27 + n + sum(lacing)
        page = bytearray(stream[at:end])
        page[22:26] = bytes(4)
        out.append(dict(flags=flags, granule=granule, sequence=sequence, crc=crc, own_crc=ogg_crc(bytes(page))))
        out[-1]["body"] = stream[at + 27 + n : end]
        at = end
    return out


def speech_like(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    voiced = sum(np.sin(2 * np.pi * 140 * k * t) / k for k in range(1, 12))
    return (0.2 * voiced * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def test_the_crc_is_ogg_s_as_sphn_writes_it() -> None:
    writer = sphn.OpusStreamWriter(SAMPLE_RATE)
    x = speech_like(1.0)
    stream = b"".join(bytes(writer.append_pcm(x[a : a + 1920])) for a in range(0, len(x) - 1919, 1920))
    found = pages(stream)
    assert len(found) > 3 and all(p["crc"] == p["own_crc"] for p in found)


def test_sphn_reads_the_stream_back_as_the_input() -> None:
    x = speech_like(2.0)
    writer, reader = OggOpusWriter(SAMPLE_RATE), sphn.OpusStreamReader(SAMPLE_RATE)
    stream, decoded = b"", []
    for a in range(0, len(x), 1280):  # the engine's 4-frame chunks: not whole 20 ms frames
        data = writer.append_pcm(x[a : a + 1280])
        stream += data
        decoded.append(np.asarray(reader.append_bytes(data), np.float32).reshape(-1))
    y = np.concatenate(decoded)
    assert len(y) == len(x) - len(x) % 480
    lag = int.from_bytes(pages(stream)[0]["body"][10:12], "little") // 2  # pre-skip, at 48 kHz
    n = len(y) - lag
    error = x[:n] - y[lag:]
    assert 10 * np.log10((x[:n] ** 2).sum() / (error**2).sum()) > 12  # dB: the same waveform, not just audio

    whole, rate = sphn.read_opus_bytes(stream)
    assert rate == 48000 and abs(whole.shape[-1] - 2 * n) <= 2 * 480


def test_pages_follow_rfc_7845() -> None:
    writer = OggOpusWriter(SAMPLE_RATE)
    stream = writer.append_pcm(np.zeros(1000, np.float32)) + writer.append_pcm(np.zeros(2000, np.float32))
    head, tags, *audio = pages(stream)
    assert head["flags"] == 2 and head["granule"] == 0
    magic, version, channels, pre_skip, rate, gain, family = struct.unpack("<8sBBHIhB", head["body"])
    assert (magic, version, channels, rate, gain, family) == (b"OpusHead", 1, 1, SAMPLE_RATE, 0, 0)
    assert pre_skip == 120  # CELT-only's 2.5 ms lookahead, in 48 kHz samples
    assert tags["body"].startswith(b"OpusTags") and tags["flags"] == 0
    assert [p["sequence"] for p in (head, tags, *audio)] == [0, 1, 2, 3]
    assert [p["granule"] for p in audio] == [2 * 960, 2 * 2880]  # 48 kHz samples in all whole 20 ms frames so far
    assert all(p["crc"] == p["own_crc"] for p in (head, tags, *audio))
    assert writer.append_pcm(np.zeros(100, np.float32)) == b""  # still short of a frame: nothing to send


def test_lacing() -> None:
    """A packet of a multiple of 255 bytes ends with a 0 lacing value; a page holds at most 255 of them."""
    page = ogg_page([bytes(255), b"x"], serial=1, sequence=0, granule=0)
    assert page[26] == 3 and page[27:30] == bytes([255, 0, 1])
    with pytest.raises(ValueError, match="255"):
        ogg_page([bytes(255 * 255)], serial=1, sequence=0, granule=0)


def test_a_long_call_spreads_its_packets_over_pages() -> None:
    """10 s in one call is 500 packets: more than a page's 255 lacing values."""
    x = speech_like(10.0)
    stream = OggOpusWriter(SAMPLE_RATE).append_pcm(x)
    audio = pages(stream)[2:]
    assert len(audio) >= 2 and audio[-1]["granule"] == 2 * len(x)
    assert all(p["crc"] == p["own_crc"] for p in audio)
    whole, _ = sphn.read_opus_bytes(stream)
    assert abs(whole.shape[-1] - 2 * len(x)) <= 2 * 480
