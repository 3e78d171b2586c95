"""bench/cascade/: the cascade answers a turn over the websocket with audio and its per-stage timestamps, and
refuses a connection its speech-to-text could not transcribe in real time; bench/cascade/stt.py's worker processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import pytest
from tests_support import until, wait_until

from bench.cascade import serve
from bench.cascade.server import CascadeServer
from bench.cascade.stt import AtCapacity, SttWorkers, Transcriber
from bench.cascade.text import printable, split_phrase, text_engine_for
from codec import EncodecTokenizer
from codec.pcm import load_wav
from s2s import Engine, EngineConfig, ModelConfig, S2SModel
from server.app import ServerOptions
from server.moshi.client import talk
from speech.sample import SAMPLE_PATH, speech

STAGES = ["endpoint", "stt_done", "llm_first_token", "phrase_ready", "tts_first_audio", "sent"]


def tiny_engines(**text_config) -> tuple[Engine, Engine]:
    """The cascade's text engine and speech engine, `tiny` and seeded, room for 2 conversations each."""
    tok = EncodecTokenizer.from_pretrained(seed=0)
    cfg = EngineConfig(calibration_ticks=0, max_conversations=2, max_reply_frames=75, frames_per_tick=4)
    speech_engine = Engine(S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0), tok, cfg)
    return text_engine_for("tiny", 1.0, 2, calibration_ticks=0, **text_config), speech_engine


def test_phrases_and_printable_bytes() -> None:
    assert split_phrase("  abc de", 1) == ("abc", "de")
    assert split_phrase("abc", 1) is None
    assert split_phrase("abc defg hij klm", 5) == ("abc defg", "hij klm")
    text = printable(np.arange(300))
    assert len(text) == 300 and set(text) <= set("abcdefghijklmnopqrstuvwxyz ")


@pytest.mark.paced  # at real time: alone and last (tests/conftest.py)
@pytest.mark.parametrize("tts", ["espeak", "engine"])
def test_cascade_answers_a_turn(tts: str) -> None:
    text_engine, speech_engine = tiny_engines()
    wav, _ = speech("What is the weather like tomorrow?")

    async def run():
        server = CascadeServer(text_engine, speech_engine, ServerOptions(port=0), stt_workers=1)
        port = await server.start()
        try:
            return await talk(f"ws://127.0.0.1:{port}", wav, "turn", "pcm16", speed=4, listen_s=30, tts=tts, seed="1")
        finally:
            await server.stop()

    result = asyncio.run(run())
    assert result.handshake and not result.errors
    assert len(result.reply) > 0 and result.turn_latency_s is not None
    first = next(m for m in result.metadata if m.get("event") == "first_audio")
    times = [first["times"][k] for k in STAGES]
    assert times == sorted(times), first["times"]
    assert any(m.get("event") == "reply_done" for m in result.metadata)


def transcribe_here(*utterances: np.ndarray) -> list[str]:
    """One decoder's finals, utterance after utterance (its noise normalization carries over between them)."""
    t, finals = Transcriber(), []
    for pcm in utterances:
        for a in range(0, len(pcm), 1920):
            t.push(pcm[a : a + 1920])
        finals.append(t.final())
    return finals


def test_stt_workers_transcribe_as_one_decoder_and_price_streams() -> None:
    pcm = load_wav(SAMPLE_PATH)
    other = np.concatenate([np.zeros(12000, dtype=np.float32), pcm[::-1]])
    want_a, want_b = transcribe_here(pcm, pcm), transcribe_here(other)
    assert want_a[0], "the bundled speech should give a transcript"

    async def run() -> None:
        workers = SttWorkers(1, headroom=0.75, max_streams=4)
        try:
            await workers.start(pcm)
            assert workers.rtf > 0
            capacity = workers.per_worker()
            workers.per_worker = lambda: 2  # two streams on one worker, however slow the machine
            a, b = workers.open(), workers.open()  # interleaved, they keep apart
            for i in range(0, max(len(pcm), len(other)), 1920):
                await asyncio.gather(a.push(pcm[i : i + 1920]), b.push(other[i : i + 1920]))
            assert [await a.final(), await b.final()] == [want_a[0], want_b[0]]
            await b.close()
            for i in range(0, len(pcm), 1920):  # a's next utterance starts after its final search
                await a.push(pcm[i : i + 1920])
            assert await a.final() == want_a[1]
            await a.close()

            workers.per_worker = lambda: capacity
            streams = [workers.open() for _ in range(capacity)]  # idle: takes one at least
            with pytest.raises(AtCapacity, match="speech-to-text is at capacity"):
                workers.open()
            await streams.pop().close()
            streams.append(workers.open())  # a closed stream's slot is free again
            for s in streams:
                await s.close()
            assert workers.load == [0]
        finally:
            workers.shutdown()

    asyncio.run(run())


@pytest.mark.paced  # at real time: alone and last (tests/conftest.py)
def test_cascade_refuses_what_its_stt_cannot_take_and_keeps_serving() -> None:
    """Headroom so small that one stream fills a worker: the second connection is refused with the reason, the
    first still gets its reply."""
    text_engine, speech_engine = tiny_engines(admission_headroom=0.01)
    wav, _ = speech("What is the weather like tomorrow?")

    async def run():
        server = CascadeServer(text_engine, speech_engine, ServerOptions(port=0), stt_workers=1)
        port = await server.start()
        url = f"ws://127.0.0.1:{port}"
        try:  # both at once: admission must not let the second in while the first's engines open
            return await asyncio.gather(
                *(talk(url, wav, "turn", "pcm16", speed=2, listen_s=30, seed=str(i)) for i in range(2))
            )
        finally:
            await server.stop()

    results = asyncio.run(run())
    refused = [r for r in results if any("refused: speech-to-text is at capacity" in e for e in r.errors)]
    served = [r for r in results if not r.errors and len(r.reply) > 0]
    assert len(refused) == 1 and len(served) == 1, [r.errors for r in results]
    assert len(refused[0].reply) == 0


def test_a_dead_stt_worker_is_replaced() -> None:
    pcm = load_wav(SAMPLE_PATH)[:24000]

    async def kill(workers: SttWorkers) -> None:
        os.kill(await asyncio.get_running_loop().run_in_executor(workers.pools[0], os.getpid), signal.SIGKILL)

    async def transcribes(workers: SttWorkers) -> None:
        stream = workers.open()
        for a in range(0, len(pcm), 1920):
            await stream.push(pcm[a : a + 1920])
        assert await stream.final() == transcribe_here(pcm)[0]
        await stream.close()

    async def run() -> None:
        workers = SttWorkers(1, headroom=0.75, max_streams=2)
        try:
            await workers.start(pcm)
            doomed = workers.open()
            await doomed.push(pcm)
            await kill(workers)  # under a stream: its next call finds it
            with pytest.raises(BrokenProcessPool):
                await doomed.final()
            await transcribes(workers)  # on the new process, beside the dead stream
            await doomed.close()
            assert workers.load == [0]
            await kill(workers)  # while no stream calls it: the next open finds it
            await until(lambda: workers.pools[0]._broken, 10, "the executor did not notice its worker gone")
            await transcribes(workers)
            assert workers.load == [0]
        finally:
            workers.shutdown()

    asyncio.run(run())


def test_stt_workers_exit_with_their_server() -> None:
    """A server that dies without shutting its workers down (SIGKILL, or SIGTERM before the handler) leaves none."""
    code = (
        "import os\n"
        "from bench.cascade.stt import SttWorkers\n"
        "w = SttWorkers(1, 0.75, 1)\n"
        "print(w.pools[0].submit(os.getpid).result(), flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    worker = int(out.stdout.split()[-1])
    wait_until(lambda: not _alive(worker), 10, f"worker {worker} outlived its server")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited


def test_cascade_server_process_stops_cleanly_on_sigterm() -> None:
    """`python -m bench.cascade.serve` in a child process (as the bench runs it): SIGTERM stops it through
    `server.stop()` (exit status 0), and its speech-to-text workers go with it."""
    from server.process import ServerProcess

    server = ServerProcess("--preset", "tiny", "--threads", "1", "--max-conversations", "2", module=serve.MODULE)
    with server:
        pid = server.proc.pid
        children = {int(c) for f in Path(f"/proc/{pid}/task").glob("*/children") for c in f.read_text().split()}
        assert children, "the STT worker should be a child process of the server"
        assert "speech-to-text: 1 worker(s)" in server.output
    assert server.proc.returncode == 0, server.output
    wait_until(  # multiprocessing's resource tracker ends once it sees its server gone
        lambda: not any(_alive(c) for c in children), 10, lambda: f"STT workers {children} outlived their server"
    )


@pytest.mark.paced  # at real time: alone and last (tests/conftest.py)
def test_a_conversation_whose_stt_worker_dies_is_told_and_the_next_is_served() -> None:
    text_engine, speech_engine = tiny_engines()
    wav, _ = speech("What is the weather like tomorrow?")

    async def run():
        server = CascadeServer(text_engine, speech_engine, ServerOptions(port=0), stt_workers=1)
        url = f"ws://127.0.0.1:{await server.start()}"
        try:
            doomed = asyncio.create_task(talk(url, wav, "turn", "pcm16", listen_s=30, seed="1"))
            # streaming into its worker
            await until(lambda: sum(server.stt.load), 30, "the conversation opened no speech-to-text stream")
            loop = asyncio.get_running_loop()
            os.kill(await loop.run_in_executor(server.stt.pools[0], os.getpid), signal.SIGKILL)
            first = await doomed
            return first, await talk(url, wav, "turn", "pcm16", speed=4, listen_s=30, seed="2")
        finally:
            await server.stop()

    first, second = asyncio.run(run())
    assert any(e.startswith("speech-to-text failed") for e in first.errors), first.errors
    assert not second.errors and len(second.reply) > 0
