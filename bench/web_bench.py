"""Web page benchmark: the page at / in headless Chromium with a fake microphone, in each mode with each codec, and the
turn latency it shows (its own clock: from the end of your speech, by its level, to the first reply audio that
reaches it). Writes the page's screenshots, idle and mid-conversation, for the README.

    s2s bench web [--quick] [--model DIR | --preset NAME] [--json PATH] [--plot PATH]

The server is `s2s serve` in a child process, on the weights a user runs: by default the shipped codec and echo model
(what `s2s serve` serves with no flags; the screenshots show the echo), or `--model DIR`, or `--preset NAME` (seeded
weights); each row's `model` says which. It has one voice prompt (`--prompts`: an espeak-ng voice) so the picker has
one; the page speaks three sentences, 3 s apart, on one connection per mode and codec.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.browser import open_page
from bench.common import add_model_args, environment, model_choice, parser, percentiles, print_table, save_outputs
from codec.pcm import SAMPLE_RATE, save_wav
from server.process import ServerProcess
from speech.sample import synthesize

SENTENCES = [
    "Hello there, can you hear me?",
    "What is the weather going to be like tomorrow?",
    "Please book a table for two tonight.",
]
GAP_S = 3.0  # silence after each sentence: the reply plays in it


def microphone(folder: Path, sentences: list[str]) -> Path:
    parts = [np.zeros(SAMPLE_RATE // 2, np.float32)]
    for text in sentences:
        parts += [synthesize(text), np.zeros(int(GAP_S * SAMPLE_RATE), np.float32)]
    save_wav(folder / "mic.wav", np.concatenate(parts))
    return folder / "mic.wav"


async def conversation(url: str, mic: Path, mode: str, codec: str, turns: int, screenshots: dict[str, Path]) -> dict:
    """One connection: the page's turns, and (if asked) its screenshots idle and after the second reply began."""
    async with open_page(f"{url}/?mode={mode}&codec={codec}", mic) as page:
        await page.wait_for("document.querySelectorAll('#voice option').length > 1")
        if "idle" in screenshots:
            await page.screenshot(screenshots["idle"])
        await page.evaluate("window.s2sStart()")
        answered = f"window.s2s.turns.filter(t => t.latencyMs !== null).length >= {min(2, turns)}"
        await page.wait_for(answered, 60)
        if "talking" in screenshots:
            await asyncio.sleep(0.6)  # some of the reply on the picture
            await page.screenshot(screenshots["talking"])
        answered = f"window.s2s.turns.filter(t => t.latencyMs !== null).length >= {turns}"
        try:
            await page.wait_for(answered, 20 + GAP_S * turns)
        except TimeoutError:
            pass  # counted: the row says how many turns were answered
        state = await page.state()
        await page.evaluate("window.s2sStop()")
    latencies = [t["latencyMs"] for t in state["turns"] if t["latencyMs"] is not None]
    row = {
        "mode": mode,
        "codec": codec,
        "sentences": turns,
        "page_turns": len(state["turns"]),
        "answered": len(latencies),
        "problem": state["problem"],
        "server_errors": len(state["errors"]),
    }
    if latencies:
        row.update({f"latency_ms_{k}": v for k, v in percentiles(latencies).items()})
    return row


def main(argv: list[str] | None = None) -> None:
    p = parser("web", __doc__.splitlines()[0])
    add_model_args(p)
    args = p.parse_args(argv)
    choice = model_choice(args)
    runs = [("turn", "opus")] if args.quick else [(m, c) for m in ("turn", "duplex") for c in ("opus", "pcm16")]
    turns = 2 if args.quick else len(SENTENCES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        mic = microphone(folder, SENTENCES[:turns])
        (folder / "voices").mkdir()
        save_wav(folder / "voices" / "espeak_f.wav", synthesize("Hi. How can I help?", voice="en-us+f2"))
        server_args = [*choice.serve_args(), "--threads", 1, "--frames-per-tick", choice.frames(4)]
        server_args += ["--max-reply-frames", choice.frames(150)]  # 2 s
        with ServerProcess(*server_args, "--prompts", folder / "voices") as url:
            url = url.replace("ws://", "http://")
            for i, (mode, codec) in enumerate(tqdm(runs, desc="web bench", file=sys.stderr)):
                shots = {"idle": args.plot.with_name("web_idle.png"), "talking": args.plot} if i == 0 else {}
                args.plot.parent.mkdir(parents=True, exist_ok=True)
                row = asyncio.run(conversation(url, mic, mode, codec, turns, shots))
                rows.append({"model": choice.label, **row, **environment()})
    columns = [
        ("mode", "mode"),
        ("codec", "codec"),
        ("sentences", "sentences"),
        ("answered", "answered"),
        ("latency_ms_p50", "latency p50 ms"),
        ("latency_ms_p95", "latency p95 ms"),
        ("problem", "problem"),
        ("server_errors", "server errors"),
    ]
    tables = print_table(
        f"The web page's turn latency (its clock: end of speech by level -> first reply audio), {choice.label}",
        rows,
        columns,
    )
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
