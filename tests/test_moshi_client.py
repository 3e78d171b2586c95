"""Kyutai's own Moshi client (`python -m moshi.client`, moshi 0.2.13) holds a duplex conversation with the server,
headless: PulseAudio null sinks stand in for the microphone and the speaker (shared/TESTING-NOTES.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile
from tests_support import ServerThread, wait_until

from codec import EncodecTokenizer
from codec.pcm import save_wav
from s2s import Engine, EngineConfig, ModelConfig, S2SModel
from s2s.models.shipped import shipped
from server.app import ServerOptions
from speech.sample import synthesize

pytestmark = pytest.mark.paced  # servers at real time: alone and last (tests/conftest.py)

MOSHI_PYTHON = Path(__file__).resolve().parents[1] / ".venv-moshi" / "bin" / "python"
MISSING = [
    what
    for what, ok in [
        (f"{MOSHI_PYTHON} (run scripts/setup_moshi_client.sh)", MOSHI_PYTHON.exists()),
        ("pulseaudio", shutil.which("pulseaudio")),
        ("paplay/parec/pactl", shutil.which("paplay") and shutil.which("parec") and shutil.which("pactl")),
    ]
    if not ok
]


def pulse(env: dict, *args: str) -> None:
    subprocess.run(args, env=env, check=True, timeout=20, capture_output=True)


@pytest.mark.skipif(bool(MISSING), reason=f"the Moshi client needs {', '.join(MISSING)}")
def test_kyutai_moshi_client_holds_a_duplex_conversation(tmp_path: Path) -> None:
    model = S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0)
    tok = EncodecTokenizer.from_pretrained(shipped("codec"))  # the default codec: a random full-size one is too slow
    # for real time on a 2-core CPU without AVX-512, beside the client's own torch; a tick of 6 frames is Moshi's 80 ms
    engine = Engine(model, tok, EngineConfig(num_pages=512, max_context=2048, calibration_ticks=0, frames_per_tick=6))

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(runtime), "PULSE_RUNTIME_PATH": str(runtime)}
    sinks = [f"--load=module-null-sink sink_name={name} rate=24000 channels=1" for name in ("spk", "mic")]
    pulse(env, "pulseaudio", "-D", "--exit-idle-time=-1", "-n", "--load=module-native-protocol-unix", *sinks)
    speech = synthesize("Hello, can you hear me? I am the Moshi client.")
    wav = tmp_path / "said.wav"
    save_wav(wav, np.concatenate([speech, np.zeros(12000, np.float32)]))
    heard = tmp_path / "heard.wav"
    processes: list[subprocess.Popen] = []
    try:
        wait_until(  # the daemon forks; its socket appears a moment later
            lambda: subprocess.run(["pactl", "info"], env=env, capture_output=True).returncode == 0,
            10,
            "pulseaudio did not start",
        )
        pulse(env, "pactl", "set-default-sink", "spk")
        pulse(env, "pactl", "set-default-source", "mic.monitor")
        with ServerThread(engine, ServerOptions(port=0)) as port:
            recorder = subprocess.Popen(
                [
                    "parec",
                    "--device=spk.monitor",
                    "--rate=24000",
                    "--channels=1",
                    "--format=s16le",
                    "--file-format=wav",
                    str(heard),
                ],
                env=env,
            )
            processes.append(recorder)
            client = subprocess.Popen(
                [str(MOSHI_PYTHON), "-m", "moshi.client", "--url", f"http://127.0.0.1:{port}"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            processes.append(client)
            wait_until(  # the client imports torch first: seconds
                lambda: engine.snapshot().conversations or client.poll() is not None, 30, "the Moshi client hangs"
            )
            assert engine.snapshot().conversations, (
                f"the Moshi client opened no conversation: {client.communicate()[0]}"
            )
            pulse(env, "paplay", "--device=mic", str(wav))  # what the client's microphone hears, in real time

            def caught_up() -> tuple[list] | None:  # (a tuple: an empty list of sessions is an answer too)
                live = engine.snapshot().sessions
                return (live,) if len(live) != 1 or live[0]["steps"] >= len(speech) / 320 else None

            # the engine has stepped through as much of the stream as the speech lasted
            (live,) = wait_until(
                caught_up, 30, lambda: f"the engine is behind the speech: {engine.snapshot().sessions}"
            )
            client.terminate()
            output = client.communicate(timeout=20)[0]
            recorder.terminate()
            recorder.wait(10)
            wait_until(  # the client's disconnect reaches the engine a moment later
                lambda: not engine.snapshot().conversations, 5, "the client's conversation was not closed"
            )
        after = engine.snapshot()
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
        subprocess.run(["pulseaudio", "--kill"], env=env, capture_output=True)

    assert "connected!" in output, output
    assert "Lost connection" not in output, output
    assert len(live) == 1 and live[0]["mode"] == "duplex", live
    # the server heard the client's microphone for as long as the speech played (Opus at 24 kHz both ways)
    assert live[0]["steps"] >= len(speech) / 320, (live[0]["steps"], len(speech) / 320)
    assert after.cache.private == 0 and after.conversations == 0
    # and the client played the model's reply: its speaker carried audio, not silence
    played, rate = soundfile.read(heard, dtype="float32")
    assert rate == 24000 and len(played) > 24000, (rate, len(played))
    assert np.sqrt(np.mean(played**2)) > 1e-3, "the client's speaker stayed silent"
