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
import contextlib
import itertools
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.connection import wait

import numpy as np
import soxr

from codec.pcm import SAMPLE_RATE, to_pcm16

try:
    from pocketsphinx import Decoder
except ImportError as e:
    raise ImportError(
        "the cascade's speech-to-text needs pocketsphinx, an extra for benchmarks and tests: "
        "pip install -e '.[bench]' (scripts/setup.sh installs it)"
    ) from e

log = logging.getLogger("s2s.stt")
RATE = 16000


class Transcriber:
    """One per conversation at a time (the decoder holds the utterance); `reset` makes it ready for the next one."""

    def __init__(self):
        self.decoder = Decoder(samprate=RATE, logfn=os.devnull)
        self.resampler = soxr.ResampleStream(SAMPLE_RATE, RATE, 1, dtype="float32")
        self.decoder.start_utt()

    def push(self, pcm: np.ndarray) -> None:
        """User PCM (float32, 24 kHz) into the running search."""
        audio = self.resampler.resample_chunk(np.asarray(pcm, dtype=np.float32))
        if len(audio):
            self.decoder.process_raw(to_pcm16(audio), False, False)

    def final(self) -> str:
        """End the utterance: the final search over what was pushed; the next pushes start a new utterance."""
        self.decoder.end_utt()
        hyp = self.decoder.hyp()
        self.decoder.start_utt()
        return hyp.hypstr if hyp is not None else ""

    def reset(self) -> None:
        self.decoder.end_utt()
        self.resampler = soxr.ResampleStream(SAMPLE_RATE, RATE, 1, dtype="float32")
        self.decoder.start_utt()


# ---- in a worker process: its decoders, by stream id ---------------------------------------------------------------

_free: list[Transcriber] = []
_streams: dict[int, Transcriber] = {}


def _init() -> None:
    """Exit with the server, however it ends (a worker waits on a queue it holds itself: it would never see EOF)."""
    parent = multiprocessing.parent_process()
    threading.Thread(target=lambda: (wait([parent.sentinel]), os._exit(0)), daemon=True).start()


def _preload(decoders: int) -> None:
    _free.extend(Transcriber() for _ in range(max(0, decoders - len(_free) - len(_streams))))


def _calibrate(pcm: np.ndarray) -> float:
    """Seconds of search per second of audio, on a decoder of its own (not one a stream will use)."""
    t = Transcriber()
    start = time.perf_counter()
    for a in range(0, len(pcm), SAMPLE_RATE // 10):
        t.push(pcm[a : a + SAMPLE_RATE // 10])
    t.final()
    return (time.perf_counter() - start) / (len(pcm) / SAMPLE_RATE)


def _open(sid: int) -> None:
    _streams[sid] = _free.pop() if _free else Transcriber()


def _stream(sid: int) -> Transcriber:
    if sid not in _streams:
        raise RuntimeError(f"speech-to-text stream {sid} is not open here (its decoder failed to load?)")
    return _streams[sid]


def _push(sid: int, pcm: np.ndarray) -> float:
    start = time.perf_counter()
    _stream(sid).push(pcm)
    return time.perf_counter() - start


def _final(sid: int) -> tuple[str, float]:
    start = time.perf_counter()
    return _stream(sid).final(), time.perf_counter() - start


def _close(sid: int) -> None:
    if (t := _streams.pop(sid, None)) is not None:
        t.reset()
        _free.append(t)


# ---- in the server --------------------------------------------------------------------------------------------------


class AtCapacity(Exception):
    """No worker can transcribe another stream in real time (the server refuses the connection)."""


DECAY = 0.99  # per measured call: the cost estimate follows about the last 100 calls (8 s of one stream's audio)


@dataclass
class SttStream:
    """One connection's speech-to-text, on one worker process (its decoder is there); its calls run in order."""

    workers: SttWorkers
    worker: int
    pool: ProcessPoolExecutor  # the worker's process when the stream opened: if it dies, the stream's calls fail
    sid: int
    closed: bool = False

    async def push(self, pcm: np.ndarray) -> None:
        busy = await self._call(_push, self.sid, pcm)
        self.workers.account(busy, len(pcm) / SAMPLE_RATE)

    async def final(self) -> str:
        text, busy = await self._call(_final, self.sid)
        self.workers.account(busy, 0.0)
        return text

    async def close(self) -> None:
        """Free the stream's slot at once, then its decoder (nothing to free if its process died: its slot went with
        it, see `SttWorkers.replace`)."""
        if self.closed:
            return
        self.closed = True
        if self.pool is self.workers.pools[self.worker]:
            self.workers.load[self.worker] -= 1
        with contextlib.suppress(BrokenProcessPool):
            await self._call(_close, self.sid)

    async def _call(self, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except BrokenProcessPool:
            self.workers.replace(self.worker, self.pool)
            raise


class SttWorkers:
    """`workers` processes (spawned: the server holds torch threads a fork would copy), each holding pocketsphinx
    decoders; a single-process executor runs a worker's calls one at a time in submission order. `rtf`: seconds of
    search per second of audio, calibrated at start, then measured over recent calls. A worker found dead (by a
    call of one of its streams, or when a stream opens on it) is replaced: its streams' calls fail, new streams go to
    the new process."""

    def __init__(self, workers: int, headroom: float, max_streams: int):
        if workers < 1 or max_streams < 1 or not 0 < headroom <= 1:
            raise ValueError(
                f"need workers >= 1, max_streams >= 1 and 0 < headroom <= 1, got {workers}, {max_streams}, {headroom}"
            )
        self.headroom, self.max_streams = headroom, max_streams
        self.pools = [self._pool() for _ in range(workers)]
        self.load = [0] * workers  # open streams per worker
        self._busy_s = self._audio_s = 0.0
        self._ids = itertools.count()

    async def start(self, calibration_pcm: np.ndarray) -> None:
        """Calibrate a stream's cost, then load the decoders the workers will admit (no model load in a turn)."""
        loop = asyncio.get_running_loop()
        rtfs = await asyncio.gather(*(loop.run_in_executor(p, _calibrate, calibration_pcm) for p in self.pools))
        self._busy_s, self._audio_s = max(rtfs), 1.0  # the slowest worker's second of audio
        await asyncio.gather(*(loop.run_in_executor(p, _preload, self.preload()) for p in self.pools))

    @property
    def rtf(self) -> float:
        return self._busy_s / self._audio_s if self._audio_s > 0 else 0.0

    def per_worker(self) -> int:
        """Streams one worker transcribes in real time within the headroom (at least one)."""
        return max(1, int(self.headroom / self.rtf)) if self.rtf > 0 else 1

    def preload(self) -> int:
        return min(self.per_worker(), -(-self.max_streams // len(self.pools)))

    def open(self) -> SttStream:
        """A stream on the least loaded worker, or `AtCapacity` when none can take one more in real time. An idle pool
        always takes one. Synchronous: a check and a reservation no other connection can come between."""
        worker = self.load.index(min(self.load))
        if sum(self.load) and self.load[worker] >= self.per_worker():
            raise AtCapacity(
                f"speech-to-text is at capacity: {sum(self.load)} streams on {len(self.pools)} worker(s), each "
                f"stream {self.rtf:.2f} s of search per second of audio, {self.headroom:.0%} of a worker at most"
            )
        sid = next(self._ids)
        try:
            self.pools[worker].submit(_open, sid)  # runs before the stream's first call (submission order)
        except BrokenProcessPool:  # it died while no stream was calling it
            self.replace(worker, self.pools[worker])
            self.pools[worker].submit(_open, sid)
        self.load[worker] += 1
        return SttStream(self, worker, self.pools[worker], sid)

    def account(self, busy_s: float, audio_s: float) -> None:
        self._busy_s = DECAY * self._busy_s + busy_s
        self._audio_s = DECAY * self._audio_s + audio_s

    def replace(self, worker: int, dead: ProcessPoolExecutor) -> None:
        """A new process for `worker` once its pool broke (once: later failures of the same pool find it replaced)."""
        if self.pools[worker] is dead:
            log.error("speech-to-text worker %d died; starting another", worker)
            self.pools[worker] = self._pool()
            self.pools[worker].submit(_preload, self.preload())
            self.load[worker] = 0  # the dead process's streams hold no slot on the new one

    def shutdown(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _pool() -> ProcessPoolExecutor:
        return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_init)


def default_workers() -> int:
    """Half this machine's cores for speech-to-text; the rest run the engines, the VAD and the event loop."""
    return max(1, len(os.sched_getaffinity(0)) // 2)
