"""The `s2s` command: `serve`, `client`, `demo`, `roundtrip` (the codec alone), `weights`, `train codec|echo` and
`bench NAME` (bench/)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import pkgutil
import runpy
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from codec import EncodecTokenizer
    from s2s import Engine
    from server.app import ChatServer, ServerOptions


def _bench_names() -> list[str]:
    """Benchmark names as typed: `bench/NAME_bench.py` with underscores in NAME written as dashes."""
    spec = importlib.util.find_spec("bench")  # finds the folder without importing it
    modules = pkgutil.iter_modules(spec.submodule_search_locations if spec else [])
    return sorted(m.name.removesuffix("_bench").replace("_", "-") for m in modules if m.name.endswith("_bench"))


def roundtrip(args: argparse.Namespace) -> None:
    """Real speech through the streaming encoder (80 ms blocks, as a client sends) and decoder (frame by frame)."""
    import torch

    from codec import EncodecTokenizer
    from s2s.weights import shipped
    from server.audio import load_wav, save_wav
    from server.speech import speech

    codec = args.codec or (None if args.random_weights else shipped("codec"))
    tok = EncodecTokenizer.from_pretrained(codec, bandwidth=args.bandwidth)
    weights = f"checkpoint {codec}" if codec else "seeded random weights (output is noise)"
    wav, source = (load_wav(args.wav), str(args.wav)) if args.wav else speech(args.text)
    wav = wav[: len(wav) // tok.frame_size * tok.frame_size]
    print(f"codec: EnCodec 24 kHz, {tok.bandwidth} kbps, {tok.num_codebooks} codebooks, {weights}")
    print(f"input: {len(wav) / tok.sample_rate:.2f} s of speech from {source}")

    enc, dec = tok.streaming_encoder(1), tok.streaming_decoder(1)
    codes, audio, first_out, t0 = [], [], None, time.perf_counter()
    for a in range(0, len(wav), 1920):
        new = enc.push(wav[None, a : a + 1920])[0]
        for f in range(new.shape[-1]):
            frame = new[:, f : f + 1]
            codes.append(frame)
            audio.append(dec.push(frame[None])[0])
            if first_out is None:
                first_out = time.perf_counter() - t0
    elapsed = time.perf_counter() - t0
    codes_t = torch.cat(codes, -1)[None]
    stream = torch.cat(audio).numpy()
    offline_codes = tok.encode(wav)
    offline = tok.decode(offline_codes)[0].numpy()
    settled = (tok.decoder_warmup_frames - 1) * tok.frame_size
    print(
        f"codes: {codes_t.shape[-1]} frames x {tok.num_codebooks} codebooks; first frames of codebook 0: "
        f"{codes_t[0, 0, :10].tolist()}"
    )
    print(f"streaming codes equal offline encode(): {bool(torch.equal(codes_t, offline_codes))}")
    print(
        f"streaming audio vs offline decode(): max |diff| {np.abs(stream[settled:] - offline[settled:]).max():.2e} "
        f"(from frame {tok.decoder_warmup_frames - 1} on)"
    )
    print(
        f"first audio out {first_out * 1000:.1f} ms after the first block went in; "
        f"{elapsed:.2f} s compute for {len(wav) / tok.sample_rate:.2f} s of audio "
        f"(RTF {elapsed / (len(wav) / tok.sample_rate):.2f})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_wav(args.out, stream)
    print(f"wrote {args.out}")


def weights_of(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """The codec and model folders `add_engine_args` names: given ones, else the shipped ones; None for seeded random
    weights (`--random-weights`, or a `--preset` without `--model`: benchmarks and tests keep their presets)."""
    from s2s.weights import shipped

    random = args.random_weights or (args.preset is not None and args.model is None)
    codec = args.codec or (None if random else shipped("codec"))
    model = args.model or (None if random else shipped("model"))
    return codec, model


def weights(args: argparse.Namespace) -> None:
    import json

    from s2s.weights import shipped

    folders = {"codec": shipped("codec"), "model": shipped("model")}
    if args.json:
        print(json.dumps({name: str(folder) for name, folder in folders.items()}))
        return
    for name, folder in folders.items():
        made = json.loads((folder / "training.json").read_text())
        size = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
        print(f"{name}: {folder} ({size:.1f} MB), made by `{made['command']}` in {made['seconds'] / 60:.0f} min")


def placement_of(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """`--device` and `--dtype` (`add_engine_args`) resolved for this machine."""
    from s2s import placement

    try:
        return placement(args.device, args.dtype)
    except ValueError as e:
        raise SystemExit(f"--device/--dtype: {e}") from None


def engine_of(args: argparse.Namespace, frontends: int = 0) -> tuple[Engine, EncodecTokenizer]:
    """The engine `add_engine_args` describes, with the voice prompts of `--prompts`, and its codec; `frontends`: the
    front-end processes beside it (their cores are not the engine's)."""
    import torch

    from codec import EncodecTokenizer
    from s2s import Engine, EngineConfig, ModelConfig, S2SModel
    from s2s.config import FRAME_S
    from server.prompts import load_prompts

    torch.set_num_threads(args.threads or default_threads(frontends))
    device, dtype = placement_of(args)
    codec, folder = weights_of(args)
    tok = EncodecTokenizer.from_pretrained(codec, bandwidth=args.bandwidth, device=device)
    if folder:
        model = S2SModel.from_pretrained(folder, dtype=dtype, device=device)
    else:
        cfg = ModelConfig.preset(args.preset or "small", num_codebooks=tok.num_codebooks)
        model = S2SModel.from_seed(cfg, seed=0, dtype=dtype, device=device)
    cfg = EngineConfig(
        cache_mode=args.cache,
        max_conversations=args.max_conversations,
        frames_per_tick=args.frames_per_tick,
        num_pages=args.kv_pages,
        max_reply_frames=args.max_reply_frames,
        max_context=round(args.max_context_s / FRAME_S),
        admission_headroom=args.admission_headroom,
        jitter_buffer_s=args.jitter_buffer_ms / 1000 if args.jitter_buffer_ms else None,
        cuda_graphs=not args.enforce_eager,
        deterministic=args.deterministic,
    )
    engine = Engine(model, tok, cfg)
    for name, codes in (load_prompts(args.prompts, tok) if args.prompts else {}).items():
        engine.add_voice(name, codes)
    return engine, tok


def default_threads(frontends: int) -> int:
    """Torch's CPU threads for the engine: every core but the front ends' (in one process, but the event loop's).
    An op's threads wait for each other, so one more than the cores left stalls every op while another thread of
    the machine runs (`s2s bench concurrency` measured it, `bench/RESULTS.md`)."""
    return max(1, len(os.sched_getaffinity(0)) - max(frontends, 1))  # (the cores this process may run on)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None, help="S2S model folder (default: the shipped echo model)")
    p.add_argument(
        "--preset", default=None, help="a seeded random model of this shape: tiny, small, base, large (random weights)"
    )
    p.add_argument("--codec", type=Path, default=None, help="Hugging Face EnCodec 24 kHz folder (default: shipped)")
    p.add_argument(
        "--random-weights", action="store_true", help="seeded random weights (model and codec) instead of the shipped"
    )
    p.add_argument("--bandwidth", type=float, default=1.5, help="codec kbps: 1.5, 3, 6, 12 or 24")
    p.add_argument("--cache", default="radix", help="naive, paged, exact or radix")
    p.add_argument("--kv-pages", type=int, default=4096, help="K/V pages of 16 steps")
    p.add_argument("--max-conversations", type=int, default=32)
    p.add_argument(
        "--admission-headroom", type=float, default=0.75, help="admit while a predicted tick stays under this share"
    )
    p.add_argument("--jitter-buffer-ms", type=float, default=0, help="duplex deadline slack (default: 80 ms + a tick)")
    p.add_argument("--max-reply-frames", type=int, default=750, help="turn mode: longest reply (75 frames a second)")
    p.add_argument(
        "--max-context-s",
        type=float,
        default=30.0,
        help="seconds of recent conversation a step attends to, besides its voice prompt; older pages go back to "
        "the pool, so a conversation runs for as long as its user talks",
    )
    p.add_argument("--frames-per-tick", type=int, default=4, help="duplex frames per engine tick (1 = 13.3 ms)")
    p.add_argument("--prompts", type=Path, default=None, help="folder of voice prompts (audio files)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (default: every core but the front ends', or in one process the event loop's)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (auto: the first CUDA GPU, else the CPU)")
    p.add_argument("--enforce-eager", action="store_true", help="on a GPU, run decode rounds without CUDA graphs")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="a reply depends only on its seed, input and weights, not on load, chunking or cache mode (CPU fp32)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="model weights and K/V: float32, bfloat16, float16 (auto: bf16 on a GPU, whatever the checkpoint "
        "holds; fp32 on a CPU)",
    )


def add_server_args(p: argparse.ArgumentParser) -> None:
    """What `s2s serve` takes: the engine's options and the server's."""
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8998)
    p.add_argument(
        "--token", default=None, help="require ?token=... or Authorization: Bearer ... on the websocket (not empty)"
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model name a Realtime API client must ask for (default: any)"
    )
    p.add_argument("--ssl-certfile", type=Path, default=None, help="serve https and wss with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", type=Path, default=None, help="... and this private key (PEM)")
    p.add_argument(
        "--allowed-origin",
        action="append",
        help="a browser origin allowed besides the server's own, e.g. https://app.example (repeatable)",
    )
    p.add_argument("--replica-id", default=None, help="this server's name, told to each client (default: none)")
    p.add_argument(
        "--forwarded-allow-ips",
        action="append",
        help="a proxy's address whose X-Forwarded-For names the client, for the per-client limit (repeatable)",
    )
    p.add_argument("--vad-silence", type=float, default=0.5, help="turn mode: seconds of silence that end a turn")
    p.add_argument(
        "--vad-min-speech",
        type=float,
        default=0.25,
        help="turn mode: seconds of confident speech a turn needs before it costs a reply (0: any)",
    )
    p.add_argument(
        "--vad-resume",
        type=float,
        default=0.5,
        help="turn mode: speech within this many seconds of an end of turn continues the turn; its reply is "
        "cancelled (0: never)",
    )
    p.add_argument(
        "--vad-confident",
        type=float,
        default=0.8,
        help="turn mode: while the engine is saturated, only turns this confident (0-1) get a reply (0: all)",
    )
    p.add_argument(
        "--vad-max-replies",
        type=int,
        default=0,
        help="turn mode: the engine is saturated with this many replies in flight (0: when its ticks are 75%% full)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        help="close a connection whose client sends no audio this many seconds (a reply playing to it is not idle)",
    )
    p.add_argument(
        "--max-unread-s",
        type=float,
        default=20.0,
        help="tell and close a client that leaves this many seconds of replies unread (each one's memory bound; "
        "keep it above the longest turn reply, which is made faster than real time)",
    )
    p.add_argument(
        "--max-conversations-per-client",
        type=int,
        default=8,
        help="conversations open at once from one IP address; more are refused (0: no limit)",
    )
    p.add_argument(
        "--handshake-timeout",
        type=float,
        default=10.0,
        help="cut a connection whose HTTP request and websocket upgrade take longer (seconds)",
    )


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """What `s2s serve` takes (and `s2s cluster`, for its replicas): the server's options, and its processes."""
    add_server_args(p)
    p.add_argument(
        "--frontends",
        type=int,
        default=None,
        help="websocket front-end processes on the port, beside the engine's (default: one per 8 cores; 0: one "
        "process for everything)",
    )


def server_options(args: argparse.Namespace) -> ServerOptions:
    """`add_server_args`' server options; a bad one exits (before an engine is built: call this first)."""
    from server.app import ServerOptions
    from server.connection import Limits
    from server.vad import VadConfig

    vad = VadConfig(
        silence_s=args.vad_silence,
        min_speech_s=args.vad_min_speech,
        resume_s=args.vad_resume,
        confident=args.vad_confident,
        max_replies=args.vad_max_replies,
    )
    try:
        vad.check()
        limits = Limits(
            idle_timeout_s=args.idle_timeout,
            max_unread_s=args.max_unread_s,
            max_conversations_per_client=args.max_conversations_per_client,
        )
        origins, handshake = args.allowed_origin or [], args.handshake_timeout
        return ServerOptions(
            args.host,
            args.port,
            args.token,
            origins,
            limits=limits,
            vad=vad,
            handshake_timeout_s=handshake,
            served_model_name=args.served_model_name,
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
            forwarded_allow_ips=args.forwarded_allow_ips or [],
            replica_id=args.replica_id,
        )
    except ValueError as e:
        raise SystemExit(f"bad server options: {e}") from None


def serving_line(options: ServerOptions, port: int) -> str:
    """What a server prints once it listens (`ServerProcess` waits for it)."""
    host, s = options.host, "s" if options.ssl_certfile else ""
    return f"serving ws{s}://{host}:{port}/api/chat  (http{s}://{host}:{port}/ the page, /healthz, /metrics)"


async def serve_until_sigterm(server: ChatServer, note: Callable[[], str] | None = None) -> None:
    """Start `server`, print `note()` (if any) and the "serving" line `ServerProcess` waits for, serve until
    SIGTERM, then stop it. SIGUSR1 drains it (`ChatServer.drain`: `s2s cluster drain`)."""
    import asyncio

    from server.gc_pause import freeze_startup_heap

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)  # `ServerProcess` stops it so
    loop.add_signal_handler(signal.SIGUSR1, server.drain)
    port = await server.start()
    freeze_startup_heap()  # the process is a server from here: see server/gc_pause.py
    try:
        if note is not None:
            print(note())
        print(serving_line(server.options, port), flush=True)
        await stop.wait()
    finally:
        await server.stop()


def serve(args: argparse.Namespace) -> None:
    import uvloop

    from server.app import ChatServer
    from server.frontends import default_frontends, serve_with_frontends

    options = server_options(args)
    frontends = default_frontends() if args.frontends is None else args.frontends
    if frontends < 0:
        raise SystemExit(f"--frontends must be 0 or more, got {frontends}")
    engine = engine_of(args, frontends)[0]
    if frontends:
        sys.exit(serve_with_frontends(engine, options, frontends))
    uvloop.run(serve_until_sigterm(ChatServer(engine, options)))


def client(args: argparse.Namespace) -> None:
    import asyncio

    from server.audio import load_wav, save_wav
    from server.client import talk

    wav = load_wav(args.wav)
    result = asyncio.run(talk(args.url, wav, args.mode, args.codec, args.speed, args.listen))
    print(f"sent {len(wav) / 24000:.2f} s; got {len(result.reply) / 24000:.2f} s of audio back")
    if result.turn_latency_s is not None:
        print(f"turn latency (end of speech -> first reply audio): {result.turn_latency_s * 1000:.0f} ms")
    for e in result.errors:
        print(f"server error: {e}")
    save_wav(args.out, result.reply)
    print(f"wrote {args.out}")


async def _demo(args: argparse.Namespace) -> None:
    """A held-out sentence in a held-out voice, in turn mode (pcm16) and duplex (Ogg/Opus); the recogniser says what
    the question and each reply say."""
    from server.app import ChatServer, ServerOptions
    from server.audio import save_wav
    from server.client import talk
    from speech import oracle
    from speech.sentences import HELDOUT_SENTENCES
    from speech.voices import HELDOUT_VOICES, say

    if args.sentence not in HELDOUT_SENTENCES:
        raise SystemExit(
            f"--sentence must be one of the held-out sentences (speech/sentences.py), got {args.sentence!r}"
        )
    engine, _ = engine_of(args)
    codec, model = weights_of(args)
    server = ChatServer(engine, ServerOptions(port=0))
    port = await server.start()
    url = f"ws://127.0.0.1:{port}"
    loaded = f"model {model}, codec {codec}" if model and codec else "seeded random weights: the replies are noise"
    print(f"server on {url}/api/chat ({loaded})")
    hear = oracle.recognizer()
    try:
        question = say(args.sentence, HELDOUT_VOICES[0])
        print(f"user ({HELDOUT_VOICES[0]}): {args.sentence!r}, {len(question) / 24000:.2f} s")
        print(f"  the recogniser hears the question as: {hear.transcribe(question)!r}")
        args.out.mkdir(parents=True, exist_ok=True)
        save_wav(args.out / "question.wav", question)
        turn = await talk(url, question, mode="turn", codec="pcm16", listen_s=15.0, seed="1")
        duplex = await talk(url, question, mode="duplex", codec="opus", listen_s=1.0, seed="2")
        for name, r, how in (("turn", turn, "turn mode, pcm16"), ("duplex", duplex, "duplex, Ogg/Opus")):
            if not r.handshake or not len(r.reply):
                print(f"{how}: no reply ({'; '.join(r.errors) or 'the server refused the conversation'})")
                continue
            save_wav(args.out / f"{name}_reply.wav", r.reply)
            latency = f", turn latency {r.turn_latency_s * 1000:.0f} ms" if r.turn_latency_s else ""
            print(f"{how}: {len(r.reply) / 24000:.2f} s of reply{latency}")
            print(f"  the recogniser hears the reply as: {hear.transcribe(r.reply)!r}")
        stats = engine.snapshot().stats
        print(f"engine: {stats.ticks} ticks, {stats.refused} refused, {stats.deadline_misses} deadline misses")
        print(f"wrote question.wav, turn_reply.wav and duplex_reply.wav to {args.out}")
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cluster"]:  # its own parser: options of `s2s serve` pass through it to the replicas
        from server.cluster.cli import main as cluster

        return cluster(argv[1:])
    p = argparse.ArgumentParser(prog="s2s", description="Speech-to-speech serving engine")
    sub = p.add_subparsers(dest="command", required=True)
    rt = sub.add_parser("roundtrip", help="stream real speech through the codec and back")
    rt.add_argument("--codec", type=Path, default=None, help="Hugging Face EnCodec 24 kHz folder (default: shipped)")
    rt.add_argument("--random-weights", action="store_true", help="a seeded random codec instead of the shipped one")
    rt.add_argument("--bandwidth", type=float, default=1.5, help="kbps: 1.5, 3, 6, 12 or 24")
    rt.add_argument("--wav", type=Path, default=None, help="speech to use instead of espeak-ng's")
    rt.add_argument("--text", default="Hello there. This is a test of the speech codec.", help="what espeak-ng says")
    rt.add_argument("--out", type=Path, default=Path("out/roundtrip.wav"), help="where to write the decoded audio")
    sv = sub.add_parser("serve", help="run the websocket server")
    add_serve_args(sv)
    cl = sub.add_parser("client", help="stream a WAV file to a server and save the reply")
    cl.add_argument("url", help="ws://host:port")
    cl.add_argument("--wav", type=Path, required=True)
    cl.add_argument("--out", type=Path, default=Path("out/reply.wav"))
    cl.add_argument("--mode", default="turn", choices=["turn", "duplex"])
    cl.add_argument("--codec", default="opus", choices=["opus", "pcm16"])
    cl.add_argument("--speed", type=float, default=1.0, help="x real time")
    cl.add_argument("--listen", type=float, default=3.0, help="seconds to keep listening after the speech")
    dm = sub.add_parser("demo", help="start a server on the offline default and hold a conversation with it")
    add_engine_args(dm)
    dm.add_argument("--out", type=Path, default=Path("out/demo"), help="folder for the question and reply WAVs")
    dm.add_argument("--sentence", default="the train leaves at seven tonight", help="one of the held-out sentences")
    sub.add_parser("cluster", help="replicas behind HAProxy (s2s cluster --help), and status, add, drain")
    wt = sub.add_parser("weights", help="where the shipped codec and model are, and how they were made")
    wt.add_argument("--json", action="store_true", help='print {"codec": PATH, "model": PATH}')
    tr = sub.add_parser("train", help="train the shipped weights (s2s train codec|echo --help)")
    tr.add_argument("what", choices=["codec", "echo"], help="codec: codec/train.py; echo: s2s/train.py")
    tr.add_argument("rest", nargs=argparse.REMAINDER)
    b = sub.add_parser("bench", help="run a benchmark from bench/ (s2s bench NAME --help)")
    b.add_argument("name", help="one of: " + ", ".join(_bench_names()))
    b.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command == "roundtrip":
        roundtrip(args)
    elif args.command == "serve":
        serve(args)
    elif args.command == "client":
        client(args)
    elif args.command == "demo":
        import asyncio

        asyncio.run(_demo(args))
    elif args.command == "weights":
        weights(args)
    elif args.command == "train":
        from codec import train as codec_train
        from s2s import train as echo_train

        {"codec": codec_train.main, "echo": echo_train.main}[args.what](args.rest)
    elif args.command == "bench":
        if args.name not in _bench_names():
            p.error(f"unknown benchmark {args.name!r}; choose from {', '.join(_bench_names())}")
        sys.argv = [f"s2s bench {args.name}", *args.rest]
        runpy.run_module(f"bench.{args.name.replace('-', '_')}_bench", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
