"""The options `s2s serve`, `s2s demo`, `s2s cluster` and the cascade share: the engine's and the server's, and the
server's `ServerOptions` they make. Light: `s2s cluster` reads them without importing the engine."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from server.app import ServerOptions, proxy_listener
from server.connection import Limits
from server.vad.endpointer import VadConfig

# `--frames-per-tick 0`: the tick of this many seconds' frames, rounded, and at least one: 4 of EnCodec's 13.3 ms
# frames (53 ms), 1 of Mimi's 80 ms. A tick of whole frames keeps near the latency it had at 4 EnCodec frames, where a
# fixed count of 4 would be 320 ms at 80 ms frames.
DEFAULT_TICK_S = 0.05
CODEC_HELP = (
    "the codec: a Hugging Face EnCodec 24 kHz folder, Kyutai's Mimi safetensors file (its Kyutai config, if not "
    "Kyutai's Mimi, beside it as NAME.json) or a transformers Mimi folder (default: the shipped EnCodec)"
)


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
    p.add_argument("--codec", type=Path, default=None, help=CODEC_HELP)
    p.add_argument(
        "--random-weights", action="store_true", help="seeded random weights (model and codec) instead of the shipped"
    )
    p.add_argument("--bandwidth", type=float, default=1.5, help="EnCodec's kbps: 1.5, 3, 6, 12 or 24")
    p.add_argument("--cache", default="radix", help="naive, paged, exact or radix")
    p.add_argument("--kv-pages", type=int, default=4096, help="K/V pages of 16 steps")
    p.add_argument("--max-conversations", type=int, default=32)
    p.add_argument(
        "--admission-headroom", type=float, default=0.75, help="admit while a predicted tick stays under this share"
    )
    p.add_argument("--jitter-buffer-ms", type=float, default=0, help="duplex deadline slack (default: 80 ms + a tick)")
    p.add_argument(
        "--max-reply-frames", type=int, default=750, help="turn mode: longest reply, in codec frames (EnCodec: 75 a s)"
    )
    p.add_argument(
        "--max-context-s",
        type=float,
        default=30.0,
        help="seconds of recent conversation a step attends to, besides its voice prompt; older pages go back to "
        "the pool, so a conversation runs for as long as its user talks",
    )
    p.add_argument(
        "--frames-per-tick",
        type=int,
        default=0,
        help="codec frames per engine tick (0: those closest to 50 ms, at least one: 4 of EnCodec's 13.3 ms frames, "
        "1 of Mimi's 80 ms)",
    )
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
        help="a proxy's address whose X-Forwarded-For names the client, for the per-client limit (repeatable; any "
        "local process has 127.0.0.1)",
    )
    p.add_argument(
        "--proxy-socket",
        type=Path,
        default=None,
        help="also listen on a Unix socket made here (mode 600), for a proxy in front whose X-Forwarded-For names "
        "the client (`s2s cluster`'s HAProxy, from its private run folder)",
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
            proxy_listener=proxy_listener(args.proxy_socket) if args.proxy_socket else None,
        )
    except (ValueError, OSError) as e:
        raise SystemExit(f"bad server options: {e}") from None
