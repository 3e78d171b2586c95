"""A Moshi model's text stream (its inner monologue) served: a tiny Kyutai-layout folder, with a tiny Mimi of 80 ms
frames, written by Kyutai's own code (`tests/moshi_reference.py`, in .venv-moshi) and served by `s2s serve --model
DIR`. Each step's text piece goes out as a `0x02` message after that step's audio, as Kyutai's `moshi.server` sends
it; padding sends nothing. What the clients get is compared, exactly, with the text of the ids the model sampled
(read on the engine thread while the conversation is open): `s2s client`'s `talk` and its command line, Kyutai's own
client (headless), and the same through a front-end process. With random weights the text is random pieces."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from moshi_reference import run_reference, tiny_lm_kwargs, tiny_mimi_config
from test_moshi_client import MISSING, MOSHI_PYTHON, pulse
from test_server import http_get, speech
from tests_support import ServerThread, on_engine_thread, served, wait_until

from bench.browser import CHROMIUM, open_page
from codec.pcm import load_wav, save_wav
from s2s import AudioEvent, Engine
from s2s.models.moshi.text import TextPieces
from server.app import ServerOptions
from server.cli.engine_args import engine_of
from server.cli.main import main, parser
from server.engine_session import EngineSession, frame_texts
from server.moshi import protocol
from server.moshi.client import talk
from server.moshi.endpoint import MoshiEndpoint
from server.moshi.protocol import Kind, ProtocolError

FRAME = 1920  # Mimi's 80 ms at 24 kHz: one text id a frame
CARD = 96  # the LM's audio codebooks (the Mimi's bins); its text vocabulary is larger (128), as Moshi's is


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moshi_text")
    mimi = tiny_mimi_config(n_q=8, bins=CARD, ratios=(8, 6, 5, 4))  # a 960-sample hop, 2x down: 80 ms frames
    config = {"name": "m", "seed": 3, "lm": tiny_lm_kwargs(8, card=CARD), "batch": 1, "steps": 4, "mimi_config": mimi}
    run_reference({"configs": [config]}, out)
    return out / "m"


def serve_engine(folder: Path) -> Engine:
    """The engine `s2s serve --model DIR` builds."""
    args = parser().parse_args(["serve", "--model", str(folder), "--threads", "1", "--admission-headroom", "inf"])
    engine, _ = engine_of(args)
    assert engine.cfg.frame_size == FRAME and engine.model.config.text_stream
    return engine


class SampledText:
    """Each open conversation's text ids (model frames `[0, computed)`, column 0), read on the engine thread after
    every tick: the last read before its close holds every frame the server sent it."""

    def __init__(self, engine: Engine):
        self.ids: dict[str, np.ndarray] = {}

        def record() -> None:
            for cid, s in list(engine.sessions.items()):
                self.ids[cid] = np.array(s.model[: s.computed, 0])

        self.future = on_engine_thread(engine, record, repeat=True)

    def stop(self) -> np.ndarray:
        """The one conversation's text ids."""
        self.future.cancel()
        assert len(self.ids) == 1, list(self.ids)
        return next(iter(self.ids.values()))


def expected(pieces: TextPieces, ids: np.ndarray, frames: int) -> str:
    """The text of the frames sent, 1 .. `frames` (frame 0, Moshi's initial token, is never sent)."""
    return pieces.text(ids[1 : 1 + frames])


# ---- the pieces: framing, padding, order ------------------------------------------------------------------------


def test_text_messages_are_kind_2_and_padding_is_no_text(folder) -> None:
    assert protocol.text(" hello") == b"\x02 hello"
    assert protocol.parse(protocol.text("\u00e9t\u00e9")) == (Kind.TEXT, "\u00e9t\u00e9".encode())
    pieces = TextPieces(folder / "tokenizer.model", (3, 0))
    word = next(i for i in range(4, 128) if pieces.processor.id_to_piece(i).startswith("\u2581"))
    ids = np.array([0, 3, word, 5, 128, -1, word])  # padding, end of padding, text; ids no tokenizer has
    texts = frame_texts(pieces, ids)
    assert texts[:2] == ["", ""] and texts[4:6] == ["", ""]
    assert texts[2] == texts[6] == pieces.text([word]) and texts[2].startswith(" ")
    assert "".join(texts) == pieces.text(ids[[0, 1, 2, 3, 6]])


def test_each_frame_s_text_follows_its_audio_as_kyutais_server_sends_it(folder) -> None:
    """Kyutai's `decode_and_send`: a step's audio, then its text if it is not padding (0 or 3)."""
    pieces = TextPieces(folder / "tokenizer.model", (3, 0))
    sent: list[tuple[str, object]] = []

    class Conn:
        async def send_audio(self, pcm: np.ndarray, turn: int) -> bool:
            sent.append(("audio", float(pcm[0])))
            return True

        async def send_text(self, piece: str) -> None:
            sent.append(("text", piece))

    pcm = np.repeat(np.arange(3, dtype=np.float32), FRAME)  # frame f's samples are all f
    event = AudioEvent("c", 0, 1, pcm, text=np.array([3, 40, 41]))
    session = SimpleNamespace(text_pieces=pieces)
    asyncio.run(EngineSession._send_with_text(session, Conn(), event))
    assert sent == [
        ("audio", 0.0),
        ("audio", 1.0),
        ("text", pieces.text([40])),
        ("audio", 2.0),
        ("text", pieces.text([41])),
    ]


def test_a_text_stream_model_serves_duplex_only_and_says_so(folder) -> None:
    engine = serve_engine(folder)
    endpoint = MoshiEndpoint(engine, None, None, None)
    with pytest.raises(ProtocolError, match="duplex conversations only"):
        endpoint.accept({"mode": "turn"}, {})
    wire, _ = endpoint.accept({}, {})  # Kyutai's client asks nothing: duplex, Opus
    assert wire.codec == "opus" and wire.text(" hi") == b"\x02 hi"


# ---- served ---------------------------------------------------------------------------------------------------


async def converse(engine: Engine, url: str) -> tuple[object, list[str], np.ndarray]:
    """A duplex pcm16 conversation of 2 s through `talk`: its result, the kinds of the messages in their order, and
    the text ids the model sampled."""
    order: list[str] = []
    sampled = SampledText(engine)
    result = await talk(
        url,
        speech(2.0),
        mode="duplex",
        codec="pcm16",
        listen_s=1.0,
        on_audio=lambda _: order.append("audio"),
        on_text=lambda _: order.append("text"),
    )
    await asyncio.to_thread(wait_until, lambda: not engine.snapshot().conversations, 10, "the conversation stays")
    return result, order, sampled.stop()


def check(engine: Engine, result, order: list[str], ids: np.ndarray) -> None:
    pieces = engine.model.text_pieces
    assert result.handshake and not result.errors, result.errors
    frames = len(result.reply) // FRAME
    assert len(result.reply) == frames * FRAME and frames >= 16, len(result.reply)
    assert result.text and all(result.text), result.text  # one message per text frame, none empty
    assert "".join(result.text) == expected(pieces, ids, frames)
    # the pieces are the non-padding frames' own, in order
    texts = [t for t in frame_texts(pieces, ids[1 : 1 + frames]) if t]
    assert result.text == texts
    # each text message right after an audio message (its frame's), as Kyutai's server sends them
    assert order[0] == "audio" and "text,text" not in ",".join(order), order
    assert order.count("audio") == frames
    # ids past the audio codebooks' range are text too (a text vocabulary larger than the codebooks, as Moshi's)
    assert (ids[1 : 1 + frames] >= CARD).any(), ids


@pytest.mark.paced  # a server at real time: alone and last (tests/conftest.py)
def test_s2s_serve_sends_the_text_stream_as_kyutais_server_does(folder) -> None:
    engine = serve_engine(folder)

    async def body(url: str) -> tuple:
        settings = json.loads(await http_get(f"{url}/api/voices"))
        return settings, *await converse(engine, url)

    settings, result, order, ids = asyncio.run(served(engine, body))
    assert settings["modes"] == ["duplex"]  # the page offers duplex only
    check(engine, result, order, ids)


@pytest.mark.paced
def test_the_text_stream_through_a_front_end_process(folder) -> None:
    """The front end builds its own `TextPieces` from the core's hello (the tokenizer's path and padding ids)."""
    engine = serve_engine(folder)

    check(engine, *asyncio.run(served(engine, lambda url: converse(engine, url), frontends=1)))


@pytest.mark.paced
def test_s2s_client_prints_the_text(folder, tmp_path, capsys) -> None:
    engine = serve_engine(folder)
    wav, out = tmp_path / "said.wav", tmp_path / "reply.wav"
    save_wav(wav, speech(2.0))
    with ServerThread(engine, ServerOptions(port=0)) as port:
        sampled = SampledText(engine)
        args = ["--mode", "duplex", "--codec", "pcm16", "--listen", "1", "--wav", str(wav), "--out", str(out)]
        main(["client", f"ws://127.0.0.1:{port}", *args])
        wait_until(lambda: not engine.snapshot().conversations, 10, "the conversation stays")
        ids = sampled.stop()
    printed = capsys.readouterr().out.split("\n")
    frames = len(load_wav(out)) // FRAME
    assert frames >= 16
    assert printed[0] == expected(engine.model.text_pieces, ids, frames) and printed[0].strip(), printed
    assert printed[1].startswith("sent 2.00 s; got"), printed


@pytest.mark.paced
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/setup.sh installs it)")
def test_the_web_page_shows_the_text_under_the_model_s_lane(folder, tmp_path) -> None:
    """The page (headless Chromium, tests/test_web.py's way) offers duplex only, and shows the text it got: on the
    picture under the model's lane, and in full below it."""
    engine = serve_engine(folder)
    mic = tmp_path / "mic.wav"
    save_wav(mic, speech(2.0))

    async def body(url: str) -> tuple:
        async with open_page(f"{url}/?codec=pcm16", mic) as page:  # (no mode: the page's default is turn)
            await page.wait_for("document.querySelector('input[name=mode][value=turn]').disabled")
            await page.evaluate("window.s2sStart()")
            await page.wait_for(f"window.s2s.text.trim() && window.s2s.receivedSamples >= {16 * FRAME}", 45)
            await page.screenshot(tmp_path / "talking.png")
            await page.evaluate("window.s2sStop()")  # (no message is handled after: the socket is closing)
            shown = await page.evaluate(
                "[document.getElementById('model-text').hidden, document.getElementById('model-text-body').textContent]"
            )
            turn_offered = await page.evaluate("!document.querySelector('input[name=mode][value=turn]').disabled")
            return await page.state(), shown, turn_offered

    with ServerThread(engine, ServerOptions(port=0)) as port:
        sampled = SampledText(engine)
        state, shown, turn_offered = asyncio.run(body(f"http://127.0.0.1:{port}"))
        wait_until(lambda: not engine.snapshot().conversations, 10, "the page's conversation stays")
        ids = sampled.stop()
    assert "mode=duplex" in state["url"] and not state["problem"] and not state["errors"], state
    assert state["receivedSamples"] % FRAME == 0, state  # pcm16: whole frames, each followed by its text
    assert state["text"] == expected(engine.model.text_pieces, ids, state["receivedSamples"] // FRAME), state
    assert shown == [False, state["text"].strip()], shown
    assert not turn_offered  # (nor once the conversation has ended)


# ---- Kyutai's own client ------------------------------------------------------------------------------------------


@pytest.mark.paced
@pytest.mark.skipif(bool(MISSING), reason=f"the Moshi client needs {', '.join(MISSING)}")
def test_kyutais_client_prints_the_text(folder, tmp_path: Path) -> None:
    """`python -m moshi.client`, headless (PulseAudio null sinks for its microphone and speaker, as
    tests/test_moshi_client.py runs it): not on a terminal, it prints each text message as it comes (`RawPrinter`),
    on stdout alone (its logs go to stderr). What it printed is the text of the model's frames 1 .. F, for an F as
    long as the speech at least."""
    engine = serve_engine(folder)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(runtime), "PULSE_RUNTIME_PATH": str(runtime)}
    sinks = [f"--load=module-null-sink sink_name={name} rate=24000 channels=1" for name in ("spk", "mic")]
    pulse(env, "pulseaudio", "-D", "--exit-idle-time=-1", "-n", "--load=module-native-protocol-unix", *sinks)
    said = speech(2.0)
    wav = tmp_path / "said.wav"
    save_wav(wav, said)
    client: subprocess.Popen | None = None
    try:
        wait_until(
            lambda: subprocess.run(["pactl", "info"], env=env, capture_output=True).returncode == 0,
            10,
            "pulseaudio did not start",
        )
        pulse(env, "pactl", "set-default-sink", "spk")
        pulse(env, "pactl", "set-default-source", "mic.monitor")
        with ServerThread(engine, ServerOptions(port=0)) as port, open(tmp_path / "stderr", "w") as stderr:
            sampled = SampledText(engine)
            client = subprocess.Popen(
                [str(MOSHI_PYTHON), "-m", "moshi.client", "--url", f"http://127.0.0.1:{port}"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,  # (its " [LAG]" marks, a few bytes a message: to a file, never a full pipe)
                text=True,
            )
            wait_until(  # the client imports torch first: seconds
                lambda: engine.snapshot().conversations or client.poll() is not None, 60, "the Moshi client hangs"
            )
            assert engine.snapshot().conversations, (tmp_path / "stderr").read_text()
            pulse(env, "paplay", "--device=mic", str(wav))  # what the client's microphone hears, in real time
            wait_until(
                lambda: engine.snapshot().sessions and engine.snapshot().sessions[0]["steps"] >= len(said) / FRAME + 5,
                30,
                lambda: f"the engine is behind the speech: {engine.snapshot().sessions}",
            )
            client.terminate()
            printed = client.communicate(timeout=20)[0]
            wait_until(lambda: not engine.snapshot().conversations, 10, "the client's conversation was not closed")
            ids = sampled.stop()
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        subprocess.run(["pulseaudio", "--kill"], env=env, capture_output=True)

    logs = (tmp_path / "stderr").read_text()
    assert "connected!" in logs and "Lost connection" not in logs, logs
    pieces = engine.model.text_pieces
    frames = [f for f in range(len(ids)) if expected(pieces, ids, f) == printed]
    assert frames and max(frames) >= len(said) / FRAME, (printed, pieces.text(ids[1:]))
    assert printed.strip(), printed
