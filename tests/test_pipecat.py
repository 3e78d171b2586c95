"""pipecat's OpenAI Realtime service (pipecat-ai 1.14.0, in `.venv-pipecat`: `scripts/setup_pipecat.sh`) holds a
turn with the server's Realtime API, in manual mode (pipecat's own turn end: commit and response.create) and with
the server's VAD. The harness is `tests/pipecat_realtime.py`, run in that venv."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from tests_support import ServerThread

from codec.pcm import save_wav
from s2s import Engine, EngineConfig
from server.app import ServerOptions
from speech.sample import synthesize

pytestmark = pytest.mark.paced  # servers at real time: alone and last (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
PIPECAT_PYTHON = ROOT / ".venv-pipecat" / "bin" / "python"


@pytest.mark.skipif(not PIPECAT_PYTHON.exists(), reason=f"{PIPECAT_PYTHON} is missing: run scripts/setup_pipecat.sh")
@pytest.mark.parametrize("mode", ["manual", "server_vad"])
def test_pipecat_realtime_service_holds_a_turn(parts, tmp_path: Path, mode: str) -> None:
    model, tok = parts
    engine = Engine(model, tok, EngineConfig(num_pages=512, max_context=1024, calibration_ticks=0, max_reply_frames=40))
    wav = tmp_path / "question.wav"
    save_wav(wav, np.concatenate([synthesize("Good morning, can you hear me?"), np.zeros(24000, np.float32)]))
    with ServerThread(engine, ServerOptions(port=0, token="pipecat-token")) as port:
        run = subprocess.run(
            [
                PIPECAT_PYTHON,
                ROOT / "tests" / "pipecat_realtime.py",
                f"ws://127.0.0.1:{port}/v1/realtime",
                wav,
                "--mode",
                mode,
                "--token",
                "pipecat-token",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    result = next((line for line in run.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert result is not None, run.stderr[-3000:]
    got = json.loads(result.removeprefix("RESULT "))
    assert run.returncode == 0 and got["audio_bytes"] >= 2 * 320 and not got["errors"], (got, run.stderr[-3000:])
