"""Run by `.venv-pipecat/bin/python` (tests/test_pipecat.py): pipecat's `OpenAIRealtimeLLMService`, the Realtime
service voice agents built on pipecat use, pointed at this server, with no transport. The pipeline is the service
between two taps; speech goes in as 20 ms `InputAudioRawFrame`s in real time, and the reply's `TTSAudioRawFrame`s
come out. In manual mode a `UserStoppedSpeakingFrame` (what pipecat's own VAD sends) makes the service commit and
ask for a response; with server VAD the server ends the turn.

    python tests/pipecat_realtime.py URL WAV --mode manual|server_vad

Prints `RESULT {"audio_bytes": N, "errors": [...]}` and exits 0 when reply audio came and nothing failed."""

import argparse
import asyncio
import json
import sys
import wave

from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    LLMFullResponseEndFrame,
    TTSAudioRawFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import WorkerRunner
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

RATE = 24000


class Tap(FrameProcessor):
    def __init__(self, name, seen):
        super().__init__(name=name)
        self.seen = seen

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        self.seen(frame)
        await self.push_frame(frame, direction)


async def run(url: str, wav: str, mode: str, token: str) -> int:
    with wave.open(wav) as w:
        assert w.getframerate() == RATE and w.getsampwidth() == 2 and w.getnchannels() == 1
        pcm = w.readframes(w.getnframes())
    got = {"audio": bytearray(), "errors": [], "ended": asyncio.Event()}

    def seen(frame):
        if isinstance(frame, TTSAudioRawFrame):
            got["audio"] += frame.audio
        elif isinstance(frame, ErrorFrame):
            got["errors"].append(str(frame.error))
            got["ended"].set()
        elif isinstance(frame, LLMFullResponseEndFrame) and got["audio"]:
            got["ended"].set()

    audio = events.AudioConfiguration(
        input=events.AudioInput(format=events.PCMAudioFormat(), turn_detection=False if mode == "manual" else None),
        output=events.AudioOutput(format=events.PCMAudioFormat()),
    )
    settings = OpenAIRealtimeLLMService.Settings(
        model="s2s", session_properties=events.SessionProperties(output_modalities=["audio"], audio=audio)
    )
    llm = OpenAIRealtimeLLMService(api_key=token, base_url=url, settings=settings)
    worker = PipelineWorker(
        Pipeline([Tap("in", seen), llm, Tap("out", seen)]),
        params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE),
        idle_timeout_secs=None,
    )
    runner = WorkerRunner(handle_sigint=False, check_dangling_tasks=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    # the service connects on its StartFrame, then sends its session settings: audio before they are in is dropped
    # (no socket yet) or taken under the server's defaults (its VAD, in manual mode)
    async with asyncio.timeout(30):
        while not llm._api_session_ready:
            await asyncio.sleep(0.02)
    chunk = RATE * 2 // 50  # 20 ms
    for a in range(0, len(pcm), chunk):
        await worker.queue_frame(InputAudioRawFrame(audio=pcm[a : a + chunk], sample_rate=RATE, num_channels=1))
        await asyncio.sleep(0.02)
    if mode == "manual":
        await worker.queue_frame(UserStoppedSpeakingFrame())
    try:
        await asyncio.wait_for(got["ended"].wait(), 60)
    except TimeoutError:
        got["errors"].append("no reply within 60 s")
    await worker.queue_frame(EndFrame())
    try:
        await asyncio.wait_for(running, 10)
    except TimeoutError:
        await worker.cancel()
    print("RESULT " + json.dumps({"audio_bytes": len(got["audio"]), "errors": got["errors"]}))
    return 0 if got["audio"] and not got["errors"] else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("wav")
    p.add_argument("--mode", choices=["manual", "server_vad"], default="manual")
    p.add_argument("--token", default="unused")
    a = p.parse_args()
    sys.exit(asyncio.run(run(a.url, a.wav, a.mode, a.token)))
