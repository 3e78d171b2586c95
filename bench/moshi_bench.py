"""Moshi served side by side in one run: Kyutai's own `moshi.server` and `s2s serve --model DIR`, on one random
Moshi-shaped checkpoint, with N duplex clients at once.

    s2s bench moshi [--quick] [--json PATH] [--plot PATH] [--levels 1,2,4,8] [--seconds 15] [--threads 1]
        [--dim 320 --layers 6 --heads 5 --depformer-dim 160 --depformer-layers 2 --depformer-heads 4 --context 3000]
        [--folder DIR] [--sides kyutai,s2s]

The checkpoint: Kyutai's own code writes it (`tests/moshi_reference.py`, run in .venv-moshi): a seeded random
`LMModel` in Moshi's shape (a temporal transformer, a depformer with weights per codebook, 8 + 8 codebooks with
Moshi's delays, a sentencepiece text stream of 128 pieces, Kyutai's `lm_gen_config` sampling) at the size the flags
give, and a small random Mimi with real 80 ms frames (`tiny_mimi_config` with `ratios` (8, 6, 5, 4): 12.5 Hz, 8
codebooks), in Kyutai's layout (`config.json`, `model.safetensors`, `mimi.safetensors`, `mimi_config.json`,
`tokenizer.model`). The default size is one at which one conversation keeps real time on one core of the 2-core
Xeon this was written on, in Kyutai's server, with room to spare: 15.0 M LM parameters (6 layers x 320, 5 heads;
depformer 2 x 160), a Mimi of 0.17 M; Kyutai's step there, one thread, fp32, in a loop of its own: Mimi encode 4.1
ms, `LMGen.step` 37.3 ms, Mimi decode 3.6 ms, 45 ms in all (56 % of the frame); in its server 47 ms a frame (p50).

The servers, each in a child process, fp32 on the CPU, `--threads` torch threads (1: the clients have the other
core of a 2-core machine):
- Kyutai's `moshi.server` from .venv-moshi (`bench/moshi_kyutai_server.py`: its module unchanged, on the folder's
  files, its Mimi config given, no Hub, no SSL). It serves one conversation at a time: its websocket handler holds
  one `asyncio.Lock` for the whole conversation, so the second and later clients are upgraded at once and wait,
  their audio buffered, until the conversation before theirs ends; then it steps through their backlog as fast as
  it can. Its per-step time is its own log line (`frame handled in X ms`, one per input frame).
- `s2s serve --model DIR` (its defaults: one 80 ms frame a tick, admission on).

The clients: for N in `--levels`, N processes (`bench/moshi_client.py`) open a conversation at the same moment with
no query (duplex, Opus, as Kyutai's client does) and stream `--seconds` of espeak-ng speech in real time as
Ogg/Opus, 80 ms blocks; each listens until its replies stop (a queued one waits for its turn). Per server and N:
- kept: conversations whose audio came back in real time (by the end of their speech plus 1 s, at least 95 % of its
  length, and no gap over 1 s between audio messages), and for `s2s serve` with 0 deadline misses in the level
  (its /metrics counts them over the whole server; `kept_audio` counts without that condition);
- first audio and first text: from a client's first audio sent to the first audio it decodes and to its first
  `0x02` message (median and worst over the N); the wait for the handshake (Kyutai's lock);
- the step: `s2s serve`'s tick time from /metrics (p50 and p95 of its working ticks, over 2 ms; its encode, model
  and decode phases a tick), its deadline misses and refusals; Kyutai's per-step time from its log (p50, p95, and
  the steps over 80 ms), deadline misses n/a (it has none: a step late is audio late).

`--quick`: N = 1 and 2, 5 s of speech each.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from bench.common import environment, parser, percentiles, print_table, save_outputs, scrape, write_json
from bench.concurrency_bench import utterances
from server.process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
KYUTAI_PYTHON = ROOT / ".venv-moshi" / "bin" / "python"
FRAME_MS = 80.0
CARD = 256  # the LM's audio codebooks' size (the Mimi's bins)
TEXT_CARD = 128  # the text vocabulary: the reference trains the tokenizer on a small corpus (at most about 160)
STEP_LINE = re.compile(r"frame handled in ([0-9.]+)ms")


def lm_kwargs(args) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from moshi_reference import tiny_lm_kwargs

    return tiny_lm_kwargs(
        8,
        dim=args.dim,
        num_heads=args.heads,
        num_layers=args.layers,
        context=args.context,
        card=CARD,
        text_card=TEXT_CARD,
        depformer_dim=args.depformer_dim,
        depformer_num_heads=args.depformer_heads,
        depformer_num_layers=args.depformer_layers,
    )


def checkpoint(args, out: Path) -> tuple[Path, dict]:
    """The folder (made by Kyutai's code unless `--folder` names one) and its description for the output."""
    sys.path.insert(0, str(ROOT / "tests"))
    from moshi_reference import run_reference, tiny_mimi_config

    folder = args.folder
    if folder is None:
        mimi = tiny_mimi_config(n_q=8, bins=CARD, dim=args.mimi_dim, ratios=(8, 6, 5, 4))  # 960-sample hop: 80 ms
        spec = {"name": "moshi", "seed": 0, "lm": lm_kwargs(args), "batch": 1, "steps": 2, "mimi_config": mimi}
        print("writing the checkpoint with Kyutai's code (tests/moshi_reference.py) ...", flush=True)
        run_reference({"configs": [spec]}, out, timeout=900)
        folder = out / "moshi"
    cfg = json.loads((folder / "config.json").read_text())
    mimi_cfg = json.loads((folder / cfg["mimi_config_name"]).read_text())
    from safetensors import safe_open

    def params(path: Path) -> int:
        with safe_open(str(path), "pt") as f:
            return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118

    desc = {
        "folder": str(folder),
        "lm": {k: cfg[k] for k in ("dim", "num_heads", "num_layers", "context", "card", "text_card", "n_q", "dep_q")}
        | {k: cfg[k] for k in ("depformer_dim", "depformer_num_heads", "depformer_num_layers", "hidden_scale")},
        "lm_params": params(folder / cfg["moshi_name"]),
        "mimi": {
            "dim": mimi_cfg["seanet"]["dimension"],
            "ratios": mimi_cfg["seanet"]["ratios"],
            "n_filters": mimi_cfg["seanet"]["n_filters"],
            "frame_rate": mimi_cfg["frame_rate"],
            "codebooks": mimi_cfg["quantizer"]["n_q"],
            "bins": mimi_cfg["quantizer"]["bins"],
            "transformer_layers": mimi_cfg["transformer"]["num_layers"],
        },
        "mimi_params": params(folder / cfg["mimi_name"]),
        "lm_gen_config": cfg.get("lm_gen_config"),
    }
    return folder, desc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KyutaiServer:
    """`bench/moshi_kyutai_server.py` in .venv-moshi: its ws:// URL; its per-step times (the log), stamped."""

    def __init__(self, folder: Path, threads: int):
        self.port = free_port()
        cmd = [str(KYUTAI_PYTHON), "-u", str(ROOT / "bench" / "moshi_kyutai_server.py"), str(folder)]
        self.cmd = cmd + ["--port", str(self.port), "--threads", str(threads)]
        self.lines: list[str] = []
        self.steps: list[tuple[float, float]] = []  # (time.monotonic(), step ms)
        self._ready = threading.Event()

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if m := STEP_LINE.search(line):
                    self.steps.append((time.monotonic(), float(m.group(1))))
                if "Running on" in line:
                    self._ready.set()
            self._ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not self._ready.wait(600) or self.proc.poll() is not None:
            self.__exit__()
            raise RuntimeError("Kyutai's moshi.server did not start:\n" + "".join(self.lines[-40:]))
        return f"ws://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_clients(url: str, speech_files: list[Path], out: Path, patience_s: float) -> list[dict]:
    """N client processes that open their conversations at the same moment; their records, in order."""
    start_at = time.monotonic() + 2.0 + 0.25 * len(speech_files)  # every process started and ready
    procs, outs = [], []
    for i, wav in enumerate(speech_files):
        o = out / f"client{i}.json"
        o.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "bench.moshi_client", url, str(wav), repr(start_at), str(o)]
        procs.append(subprocess.Popen([*cmd, "--patience-s", str(patience_s)], cwd=ROOT))
        outs.append(o)
    for p in procs:
        p.wait()
    records = []
    for p, o in zip(procs, outs, strict=True):
        rec = json.loads(o.read_text()) if o.exists() else {"refusal": f"client exited {p.returncode}"}
        records.append(rec)
    return records


def bucket_quantiles(after: dict, before: dict, floor_s: float = 0.002) -> dict[str, float]:
    """p50 and p95 (ms) of the ticks over `floor_s` (working ticks: an idle tick takes well under a ms), from the
    tick time histogram's buckets between two scrapes, interpolated within a bucket."""
    prefix = 's2s_tick_seconds_bucket{le="'
    cum = sorted((float(k[len(prefix) : -2]), v - before.get(k, 0.0)) for k, v in after.items() if k.startswith(prefix))
    base = next((c for b, c in cum if b >= floor_s), 0.0)  # ticks up to the floor (a bucket bound)
    rows = [(b, c - base) for b, c in cum if b >= floor_s]
    total = rows[-1][1] if rows else 0
    out = {"working_ticks": total}
    for q in (50, 95):
        if total <= 0:
            out[f"p{q}"] = math.nan
            continue
        rank, lower, below = q / 100 * total, floor_s, 0.0
        for bound, count in rows[1:]:
            if count >= rank:
                break
            lower, below = bound, count
        upper = bound if math.isfinite(bound) else lower
        out[f"p{q}"] = 1000 * (lower + (upper - lower) * (rank - below) / max(count - below, 1e-9))
    return out


def summarize(records: list[dict]) -> dict:
    served = [r for r in records if r.get("refusal") is None]
    first_audio = [r["first_audio_s"] for r in served if r.get("first_audio_s") is not None]
    first_text = [r["first_text_s"] for r in served if r.get("first_text_s") is not None]
    handshake = [r["handshake"] for r in served if r.get("handshake") is not None]

    def ms(v: list[float], f) -> float | int:
        return round(1000 * f(v)) if v else math.nan

    return {
        "served": len(served),
        "refused": len(records) - len(served),
        "kept_audio": sum(bool(r.get("kept")) for r in served),
        "first_audio_ms_p50": ms(first_audio, np.median),
        "first_audio_ms_max": ms(first_audio, max),
        "first_text_ms_p50": ms(first_text, np.median),
        "first_text_ms_max": ms(first_text, max),
        "no_audio": len(served) - len(first_audio),
        "handshake_wait_ms_max": ms(handshake, max),
        "received_fraction_min": min((r["received_by_end_s"] / r["speech_s"] for r in served), default=math.nan),
        "max_gap_ms": ms([r["max_gap_s"] for r in served], max),
        "lag_ms_p95_max": max((r["lag_ms_p95"] for r in served if r.get("lag_ms_p95") is not None), default=math.nan),
        "first_refusal": next((r["refusal"] for r in records if r.get("refusal")), None),
    }


def level_kyutai(
    server: KyutaiServer, url: str, files: list[Path], out: Path, patience_s: float
) -> tuple[dict, list[dict]]:
    t0 = time.monotonic()
    records = run_clients(url, files, out, patience_s)
    time.sleep(1.0)
    steps = [ms for t, ms in server.steps if t >= t0]
    row = summarize(records)
    pct = percentiles(steps) if steps else {"p50": math.nan, "p95": math.nan}
    row.update(
        kept=row["kept_audio"],
        step_ms_p50=pct["p50"],
        step_ms_p95=pct["p95"],
        steps=len(steps),
        steps_over_frame=sum(ms > FRAME_MS for ms in steps),
        deadline_misses="n/a",
    )
    return row, records


def level_ours(url: str, files: list[Path], out: Path, patience_s: float) -> tuple[dict, list[dict]]:
    before, t0 = scrape(url), time.monotonic()
    records = run_clients(url, files, out, patience_s)
    wall = time.monotonic() - t0
    time.sleep(1.0)  # the closes reach the engine
    after = scrape(url)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    row = summarize(records)
    q = bucket_quantiles(after, before)
    misses = int(delta("s2s_deadline_misses_total"))
    work = q["working_ticks"]
    row.update(
        kept=row["kept_audio"] if misses == 0 else 0,
        step_ms_p50=q["p50"],
        step_ms_p95=q["p95"],
        steps=int(work),
        deadline_misses=misses,
        server_refused=int(delta("s2s_refused_total")),
        engine_rtf=delta("s2s_busy_seconds_total") / wall,
        **{
            f"tick_{phase}_ms": 1000 * delta(f's2s_tick_phase_seconds_total{{phase="{phase}"}}') / work
            if work
            else math.nan
            for phase in ("encode", "model", "decode")
        },
    )
    return row, records


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    versions = subprocess.run(
        [str(KYUTAI_PYTHON), "-c", "import moshi, torch; print(moshi.__version__, torch.__version__)"],
        capture_output=True,
        text=True,
    ).stdout.split()
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "kyutai_moshi": versions[0] if versions else "?",
        "kyutai_torch": versions[1] if len(versions) > 1 else "?",
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    levels = sorted({r["concurrency"] for r in rows})
    axes[0].plot(levels, levels, ":", color="grey", label="every client")
    for side, marker, color in (("Kyutai moshi.server", "o", "tab:blue"), ("s2s serve", "s", "tab:orange")):
        rs = [r for r in rows if r["server"] == side]
        if not rs:
            continue
        n = [r["concurrency"] for r in rs]
        axes[0].plot(n, [r["kept"] for r in rs], marker + "-", color=color, label=side)
        axes[1].plot(n, [r["first_audio_ms_max"] for r in rs], marker + "-", color=color, label=f"{side}, worst")
        axes[1].plot(n, [r["first_audio_ms_p50"] for r in rs], marker + "--", color=color, label=f"{side}, median")
    axes[0].set_title("conversations kept in real time")
    axes[0].set_ylim(0, max(levels) + 0.5)
    axes[1].set_title("first audio latency (ms)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("duplex clients at once (N)")
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = parser("moshi", __doc__.splitlines()[0])
    p.add_argument("--levels", default="1,2,4,8", help="numbers of duplex clients at once")
    p.add_argument("--seconds", type=float, default=15.0, help="speech per client")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    p.add_argument("--sides", default="kyutai,s2s", help="which servers: kyutai, s2s or both")
    p.add_argument("--folder", type=Path, default=None, help="a checkpoint folder made before (default: make one)")
    p.add_argument("--dim", type=int, default=320, help="the temporal transformer's width")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=5)
    p.add_argument("--context", type=int, default=3000, help="the LM's context in steps (Moshi's: 3,000)")
    p.add_argument("--depformer-dim", type=int, default=160)
    p.add_argument("--depformer-layers", type=int, default=2)
    p.add_argument("--depformer-heads", type=int, default=4)
    p.add_argument("--mimi-dim", type=int, default=32, help="the small Mimi's width (tiny_mimi_config)")
    p.add_argument("--patience-s", type=float, default=600.0, help="how long a client waits for audio after speaking")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint made (for --folder) and the client logs")
    args = p.parse_args()
    command = "s2s bench moshi " + shlex.join(sys.argv[1:])
    levels = [int(x) for x in args.levels.split(",")]
    if args.quick:
        levels, args.seconds = [1, 2], 5.0
    sides = args.sides.split(",")
    if not set(sides) <= {"kyutai", "s2s"}:
        raise SystemExit(f"--sides takes kyutai and s2s: {args.sides}")
    if not KYUTAI_PYTHON.exists():
        raise SystemExit(f"{KYUTAI_PYTHON} is missing: run scripts/setup_moshi_client.sh")
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="moshi-bench-"))
    try:
        measure(args, command, levels, sides, tmp, started)
    finally:
        if args.keep:
            print(f"kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def measure(args, command: str, levels: list[int], sides: list[str], tmp: Path, started: float) -> None:
    folder, desc = checkpoint(args, tmp)
    speech = utterances(args.seconds, max(levels))
    files = []
    for i, pcm in enumerate(speech):
        files.append(tmp / f"speech{i}.npy")
        np.save(files[-1], pcm.astype(np.float32))
    env = {**environment(), **machine(), "threads": args.threads, "dtype": "float32"}
    common = {"bench": "moshi", "seconds_per_client": args.seconds, "checkpoint": desc, **env}
    rows, details = [], {}
    for side in sides:
        if side == "kyutai":
            name, server = "Kyutai moshi.server", KyutaiServer(folder, args.threads)
        else:
            name = "s2s serve"
            serve = ["--model", str(folder), "--threads", str(args.threads), "--device", "cpu"]
            server = ServerProcess(*serve, "--max-conversations-per-client", "0", timeout_s=600)
        with server as url:
            for n in levels:
                print(f"{name}: {n} client(s) ...", flush=True)
                if side == "kyutai":
                    row, records = level_kyutai(server, url, files[:n], tmp, args.patience_s)
                else:
                    row, records = level_ours(url, files[:n], tmp, args.patience_s)
                rows.append({"server": name, "concurrency": n, **row, **common, "clients": records})
                details[(name, n)] = records
                write_json(args.json, rows)  # each level as it finishes
    wall = time.monotonic() - started
    lm, mimi = desc["lm"], desc["mimi"]
    size = (
        f"random Moshi-shaped LM ({desc['lm_params'] / 1e6:.1f} M parameters: {lm['num_layers']} layers x "
        f"{lm['dim']} wide, {lm['num_heads']} heads, context {lm['context']}; depformer {lm['depformer_num_layers']} "
        f"x {lm['depformer_dim']}, {lm['depformer_num_heads']} heads, {lm['dep_q']} + {lm['n_q'] - lm['dep_q']} "
        f"codebooks of {lm['card']}, text {lm['text_card']}), random Mimi ({desc['mimi_params'] / 1e6:.2f} M "
        f"parameters: SEANet {mimi['dim']} wide, ratios {mimi['ratios']}, {mimi['frame_rate']:g} Hz, "
        f"{mimi['transformer_layers']}-layer transformers)"
    )
    conditions = (
        f"{env['cpu']}, {env['cores']} cores; fp32 on the CPU, {args.threads} torch thread(s) per server; "
        f"{size}; {args.seconds:g} s of espeak-ng speech per client, Ogg/Opus both ways, clients in processes of "
        f"their own; Kyutai's moshi {env['kyutai_moshi']} (torch {env['kyutai_torch']}), s2s on torch "
        f"{env['torch']}; {wall:.0f} s in all"
    )
    columns = [
        ("server", "server"),
        ("concurrency", "N"),
        ("kept", "kept"),
        ("kept_audio", "audio kept"),
        ("refused", "refused"),
        ("first_audio_ms_p50", "1st audio p50 ms"),
        ("first_audio_ms_max", "1st audio max ms"),
        ("first_text_ms_p50", "1st text p50 ms"),
        ("first_text_ms_max", "1st text max ms"),
        ("handshake_wait_ms_max", "handshake wait max ms"),
        ("received_fraction_min", "min audio by end"),
        ("max_gap_ms", "max gap ms"),
        ("step_ms_p50", "step/tick p50 ms"),
        ("step_ms_p95", "p95 ms"),
        ("deadline_misses", "misses"),
        ("steps_over_frame", "steps > 80 ms"),
    ]
    tables = [f"`{command}`", f"Conditions: {conditions}."]
    tables += print_table("Moshi side by side: Kyutai's moshi.server and s2s serve, N duplex clients", rows, columns)
    ours = [r for r in rows if r["server"] == "s2s serve"]
    if ours:
        tables += print_table(
            "s2s serve's ticks (working ticks, over 2 ms)",
            ours,
            [
                ("concurrency", "N"),
                ("steps", "ticks"),
                ("tick_encode_ms", "encode ms"),
                ("tick_model_ms", "model ms"),
                ("tick_decode_ms", "decode ms"),
                ("engine_rtf", "engine RTF"),
                ("server_refused", "refused"),
                ("lag_ms_p95_max", "lag p95 ms (worst client)"),
            ],
        )

    def ms(v: float | None) -> int | str:
        return "-" if v is None else round(1000 * v)

    per_client = [
        {
            "server": name,
            "client": i,
            "kept": c.get("kept", False),
            "refusal": c.get("refusal") or "",
            "handshake_ms": ms(c.get("handshake")),
            "first_audio_ms": ms(c.get("first_audio_s")),
            "first_text_ms": ms(c.get("first_text_s")),
            "audio_by_end_s": c.get("received_by_end_s", 0.0),
            "audio_s": c.get("received_s", 0.0),
            "max_gap_ms": ms(c.get("max_gap_s")),
            "lag_ms_p95": c.get("lag_ms_p95"),
        }
        for (name, n), records in details.items()
        if n == max(levels)
        for i, c in enumerate(records)
    ]
    tables += print_table(
        f"Each client at N = {max(levels)} (times from its first audio sent; handshake: from its upgrade)",
        per_client,
        [
            ("server", "server"),
            ("client", "client"),
            ("kept", "kept"),
            ("refusal", "refusal"),
            ("handshake_ms", "handshake ms"),
            ("first_audio_ms", "1st audio ms"),
            ("first_text_ms", "1st text ms"),
            ("audio_by_end_s", "audio by end s"),
            ("audio_s", "audio s"),
            ("max_gap_ms", "max gap ms"),
            ("lag_ms_p95", "lag p95 ms"),
        ],
    )
    tables.append(
        "kept: by the end of its speech plus 1 s a client had at least 95 % of its speech's length back as audio, "
        "with no gap over 1 s between audio messages (from its first audio sent), and for s2s serve the level had "
        "0 deadline misses (audio kept: without that). First audio and text: from the client's first audio sent. "
        "Step: Kyutai's per-input-frame time from its log (Mimi encode, LMGen.step, Mimi decode, Opus, send); "
        "s2s serve's tick (one 80 ms frame for every conversation) from /metrics."
    )
    short = (
        f"random Moshi-shaped LM of {desc['lm_params'] / 1e6:.1f} M parameters, Mimi of "
        f"{desc['mimi_params'] / 1e6:.2f} M, fp32, {args.threads} thread(s), {env['cpu']}, {env['cores']} cores"
    )
    plot(rows, args.plot, f"Moshi, Kyutai's moshi.server and s2s serve side by side\n{short}")
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
