"""Speech-to-text for the cascade: pocketsphinx, fed while the user speaks so that only the final search is left at
the end of the turn (its streaming `process_raw`, as in pocketsphinx's live examples). 16 kHz, US English model
shipped with the wheel, free decoding with its default language model.

pocketsphinx holds the GIL while it searches: two streams in two threads of one process took 2.2x one stream's
time. `SttWorkers` therefore runs the decoders in worker processes, as a cascade's speech-to-text runs as its own
service, and prices each stream by its measured real-time factor so that the cascade refuses a connection it could
not transcribe in real time, as the engines do.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import soxr
from pocketsphinx import Decoder

RATE = 16000
IN_RATE = 24000


class Transcriber:
    """One per conversation at a time (the decoder holds the utterance); `reset` makes it ready for the next one."""

    def __init__(self):
        self.decoder = Decoder(samprate=RATE, logfn=os.devnull)
        self.resampler = soxr.ResampleStream(IN_RATE, RATE, 1, dtype="float32")
        self.decoder.start_utt()

    def push(self, pcm: np.ndarray) -> None:
        """User PCM (float32, 24 kHz) into the running search."""
        audio = self.resampler.resample_chunk(np.asarray(pcm, dtype=np.float32))
        if len(audio):
            self.decoder.process_raw((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes(), False, False)

    def final(self) -> str:
        """End the utterance: the final search over what was pushed; the next pushes start a new utterance."""
        self.decoder.end_utt()
        hyp = self.decoder.hyp()
        self.decoder.start_utt()
        return hyp.hypstr if hyp is not None else ""

    def reset(self) -> None:
        self.decoder.end_utt()
        self.resampler = soxr.ResampleStream(IN_RATE, RATE, 1, dtype="float32")
        self.decoder.start_utt()


# ---- in a worker process: its decoders, by stream id ---------------------------------------------------------------

_free: list[Transcriber] = []
_streams: dict[int, Transcriber] = {}


def _preload(decoders: int) -> None:
    _free.extend(Transcriber() for _ in range(max(0, decoders - len(_free) - len(_streams))))


def _calibrate(pcm: np.ndarray) -> float:
    """Seconds of search per second of audio, on a decoder of its own (a decoder carries its noise estimate from
    one utterance to the next: the streams' decoders start fresh)."""
    t = Transcriber()
    start = time.perf_counter()
    for a in range(0, len(pcm), IN_RATE // 10):
        t.push(pcm[a : a + IN_RATE // 10])
    t.final()
    return (time.perf_counter() - start) / (len(pcm) / IN_RATE)


def _open(sid: int) -> None:
    _streams[sid] = _free.pop() if _free else Transcriber()


def _push(sid: int, pcm: np.ndarray) -> float:
    start = time.perf_counter()
    _streams[sid].push(pcm)
    return time.perf_counter() - start


def _final(sid: int) -> tuple[str, float]:
    start = time.perf_counter()
    return _streams[sid].final(), time.perf_counter() - start


def _close(sid: int) -> None:
    t = _streams.pop(sid)
    t.reset()
    _free.append(t)


# ---- in the server --------------------------------------------------------------------------------------------------


@dataclass
class SttStream:
    """One connection's speech-to-text; its calls run in order on its worker."""

    workers: SttWorkers
    worker: int
    sid: int

    async def push(self, pcm: np.ndarray) -> None:
        busy = await self.workers.call(self.worker, _push, self.sid, pcm)
        self.workers.account(busy, len(pcm) / IN_RATE)

    async def final(self) -> str:
        text, busy = await self.workers.call(self.worker, _final, self.sid)
        self.workers.account(busy, 0.0)
        return text

    async def close(self) -> None:
        """Back to its worker's free decoders; the stream's slot is freed at once (even if the call fails)."""
        self.workers.load[self.worker] -= 1
        await self.workers.call(self.worker, _close, self.sid)


class SttWorkers:
    """`workers` processes (spawned: the server holds torch threads a fork would copy), each holding pocketsphinx
    decoders. A stream stays on one worker (its decoder is there); a single-process executor runs its calls in
    submission order. `rtf`: seconds of search per second of audio, first calibrated on `calibration_pcm`, then
    measured over every push and final search."""

    def __init__(self, workers: int, headroom: float):
        if workers < 1 or not 0 < headroom <= 1:
            raise ValueError(f"need workers >= 1 and 0 < headroom <= 1, got {workers} and {headroom}")
        self.headroom = headroom
        ctx = multiprocessing.get_context("spawn")
        self.pools = [ProcessPoolExecutor(1, mp_context=ctx) for _ in range(workers)]
        self.load = [0] * workers  # open streams per worker
        self.rtf = 0.0
        self._busy_s, self._audio_s = 0.0, 0.0
        self._ids = itertools.count()

    async def start(self, calibration_pcm: np.ndarray) -> None:
        """Calibrate the cost of a stream, then load as many decoders per worker as it admits (no load in a turn)."""
        rtfs = await asyncio.gather(*(self.call(w, _calibrate, calibration_pcm) for w in range(len(self.pools))))
        self.rtf = max(rtfs)
        self._busy_s, self._audio_s = self.rtf * len(calibration_pcm) / IN_RATE, len(calibration_pcm) / IN_RATE
        await asyncio.gather(*(self.call(w, _preload, self.per_worker()) for w in range(len(self.pools))))

    def per_worker(self) -> int:
        """Streams one worker transcribes in real time within the headroom (at least one)."""
        return max(1, int(self.headroom / self.rtf)) if self.rtf > 0 else 1

    def problem(self) -> str | None:
        """Why another stream cannot be transcribed in real time, or None. An idle pool always takes one."""
        if sum(self.load) == 0 or min(self.load) < self.per_worker():
            return None
        return (
            f"speech-to-text is at capacity: {sum(self.load)} streams on {len(self.pools)} worker(s), each stream "
            f"{self.rtf:.2f} s of search per second of audio, {self.headroom:.0%} of a worker at most"
        )

    def open(self) -> SttStream:
        """A stream on the least loaded worker; the caller checks `problem()` first."""
        worker = self.load.index(min(self.load))
        self.load[worker] += 1
        stream = SttStream(self, worker, next(self._ids))
        self.pools[worker].submit(_open, stream.sid)  # runs before the stream's first call (submission order)
        return stream

    async def call(self, worker: int, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pools[worker], fn, *args)

    def account(self, busy_s: float, audio_s: float) -> None:
        self._busy_s += busy_s
        self._audio_s += audio_s
        self.rtf = self._busy_s / self._audio_s

    def shutdown(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=True, cancel_futures=True)


def default_workers() -> int:
    """Half this machine's cores for speech-to-text; the rest run the engines, the VAD and the event loop."""
    return max(1, len(os.sched_getaffinity(0)) // 2)
