"""The server's Ogg/Opus encoder: libopus through ctypes, so that the front end can choose the encoder's mode.

sphn's writer encodes in Opus's VoIP mode at complexity 10, and that was 42 % of a front end's CPU time per stream
(bench/RESULTS.md, "The front end per stream"). Here the mode is CELT-only (restricted low delay), which costs a
fraction of that for speech the codec has already band-limited (at complexity 0, `COMPLEXITY`), and it has less
lookahead. The stream is RFC 7845's: an OpusHead page, an OpusTags page, then one page per call with its whole 20 ms
packets.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import struct
import zlib

import numpy as np

OPUS_APPLICATION_RESTRICTED_LOWDELAY = 2051
OPUS_SET_BITRATE = 4002
OPUS_SET_COMPLEXITY = 4010
OPUS_GET_LOOKAHEAD = 4027
BITRATE = 32000
# Of 0-10. Below 5, CELT drops its pitch pre-filter: the waveform is a little further from the codec's output (12.4 dB
# SNR against 15.5 at 5, on 8 held-out takes), the recogniser hears it the same (0.975 of 80 takes at 0, 3 and 5), and
# it costs under half of 5's time (bench/RESULTS.md, "The front end per stream").
COMPLEXITY = 0
OPUS_RATE = 48000  # Ogg/Opus counts granule positions and pre-skip at 48 kHz, whatever the input rate
OPUS_FRAME_S = 0.02
MAX_PACKET = 1500
VENDOR = b"s2s libopus"
SERIAL = 0x5325  # one logical stream per connection, so any serial number will do


@functools.cache
def _libopus() -> ctypes.CDLL:
    """Loaded on the first writer, so that a server speaking only PCM16 needs no libopus."""
    path = ctypes.util.find_library("opus") or "libopus.so.0"
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise RuntimeError("libopus is missing: install the system package libopus0 (scripts/setup.sh does)") from e
    lib.opus_encoder_create.restype = ctypes.c_void_p
    lib.opus_encoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.opus_encoder_destroy.argtypes = [ctypes.c_void_p]
    lib.opus_encoder_ctl.restype = ctypes.c_int
    lib.opus_encoder_ctl.argtypes = [ctypes.c_void_p, ctypes.c_int]  # and one variadic argument
    lib.opus_encode_float.restype = ctypes.c_int32
    lib.opus_encode_float.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int32]
    lib.opus_strerror.restype = ctypes.c_char_p
    return lib


# Ogg's CRC is CRC-32 (polynomial 0x04c11db7) unreflected, with no initial or final xor. zlib's crc32 is the same
# polynomial reflected, so Ogg's is zlib's over bit-reversed bytes, bit-reversed, with zlib's xors undone.
_REVERSE_BITS = bytes(int(f"{b:08b}"[::-1], 2) for b in range(256))


def ogg_crc(page: bytes) -> int:
    reflected = zlib.crc32(page.translate(_REVERSE_BITS), 0xFFFFFFFF) ^ 0xFFFFFFFF
    return int(f"{reflected:032b}"[::-1], 2)


def ogg_page(packets: list[bytes], *, serial: int, sequence: int, granule: int, flags: int = 0) -> bytes:
    """One page of whole packets (RFC 3533): each packet's length in lacing values of at most 255."""
    lacing = bytearray()
    for packet in packets:
        lacing += b"\xff" * (len(packet) // 255) + bytes([len(packet) % 255])
    if len(lacing) > 255:
        raise ValueError(f"{len(lacing)} lacing values do not fit in one Ogg page (255 at most)")
    header = struct.pack("<4sBBqIIIB", b"OggS", 0, flags, granule, serial, sequence, 0, len(lacing))
    page = bytearray(header + lacing + b"".join(packets))
    struct.pack_into("<I", page, 22, ogg_crc(bytes(page)))
    return bytes(page)


class OggOpusWriter:
    """Mono float PCM at `sample_rate` in, Ogg/Opus bytes out: what `sphn.OpusStreamWriter.append_pcm` gives."""

    def __init__(self, sample_rate: int):
        self._lib = _libopus()
        error = ctypes.c_int()
        self._encoder = self._lib.opus_encoder_create(sample_rate, 1, OPUS_APPLICATION_RESTRICTED_LOWDELAY, error)
        if error.value != 0 or not self._encoder:
            raise ValueError(f"libopus refuses {sample_rate} Hz: {self._lib.opus_strerror(error.value).decode()}")
        self._ctl(OPUS_SET_BITRATE, ctypes.c_int32(BITRATE))
        self._ctl(OPUS_SET_COMPLEXITY, ctypes.c_int32(COMPLEXITY))
        lookahead = ctypes.c_int32()
        self._ctl(OPUS_GET_LOOKAHEAD, ctypes.byref(lookahead))
        self.sample_rate = sample_rate
        self.frame = int(sample_rate * OPUS_FRAME_S)
        self._to_48k = OPUS_RATE // sample_rate
        self._pending = np.zeros(0, np.float32)  # input short of a whole frame
        self._out = ctypes.create_string_buffer(MAX_PACKET)
        self._sequence, self._granule = 0, 0
        pre_skip = lookahead.value * self._to_48k
        self._headers = self._page([struct.pack("<8sBBHIhB", b"OpusHead", 1, 1, pre_skip, sample_rate, 0, 0)], 0x02)
        self._headers += self._page([b"OpusTags" + struct.pack("<I", len(VENDOR)) + VENDOR + struct.pack("<I", 0)])

    def append_pcm(self, pcm: np.ndarray) -> bytes:
        """Encodes every whole 20 ms frame buffered, in pages of at most 255 lacing values; the header pages come
        before the first call's pages."""
        pcm = np.concatenate([self._pending, np.asarray(pcm, np.float32).reshape(-1)])
        whole = len(pcm) - len(pcm) % self.frame
        self._pending = pcm[whole:]
        frames = np.ascontiguousarray(pcm[:whole])
        out, self._headers = self._headers, b""
        page: list[bytes] = []
        lacing = 0  # the page's lacing values so far
        for a in range(0, whole, self.frame):
            packet = self._encode(frames[a : a + self.frame])
            if lacing + len(packet) // 255 + 1 > 255:
                out += self._page(page)
                page, lacing = [], 0
            page.append(packet)
            lacing += len(packet) // 255 + 1
            self._granule += self.frame * self._to_48k
        return out + self._page(page) if page else out

    def _encode(self, frame: np.ndarray) -> bytes:
        n = self._lib.opus_encode_float(self._encoder, frame.ctypes.data, self.frame, self._out, MAX_PACKET)
        if n < 0:
            raise RuntimeError(f"libopus could not encode: {self._lib.opus_strerror(n).decode()}")
        return self._out[:n]  # (`.raw` would copy the whole buffer first)

    def _page(self, packets: list[bytes], flags: int = 0) -> bytes:
        page = ogg_page(packets, serial=SERIAL, sequence=self._sequence, granule=self._granule, flags=flags)
        self._sequence += 1
        return page

    def _ctl(self, request: int, value: ctypes.c_int32 | ctypes._CArgObject) -> None:
        status = self._lib.opus_encoder_ctl(self._encoder, request, value)
        if status != 0:
            raise RuntimeError(f"libopus refused request {request}: {self._lib.opus_strerror(status).decode()}")

    def __del__(self) -> None:
        if getattr(self, "_encoder", None):
            self._lib.opus_encoder_destroy(self._encoder)
