"""Moshi at scale: how many duplex conversations one device keeps in real time, in-process, random weights.

    s2s bench moshi-scale [--shape 7b|small|tiny] [--levels 8,16,32] [--seconds S] [--device cuda]

Moshi's shape (`--shape 7b`: Kyutai's `_lm_kwargs`, 7.7B parameters, a 3,000-step window) or a smaller one, with
random weights made here on the device (nothing to bring along: Llama's init, bf16 on a GPU), and Mimi at its full
size (random). For each level N, N duplex conversations open at once and each hears a frame of noise per 80 ms
tick, the driver pacing ticks to the wall clock as the engine thread does, for `--seconds`. A conversation is kept
in real time when none of its frames missed its deadline. Rows: tick time (p50, p95), its model and codec shares,
deadline misses, conversations kept. Beside them, Kyutai's `LMGen.step` at batch 1 for the same shape on the same
device (its own random init), timed, where the `moshi` package imports: its own baseline (issue 47).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.common import add_device_args, environment, parser, percentiles, print_table, save_outputs
from codec import MimiTokenizer
from s2s import Engine, EngineConfig, SamplingParams, placement
from s2s.models.moshi.config import MOSHI_7B, MoshiConfig
from s2s.models.moshi.model import MoshiLM

SHAPES = {
    "7b": MOSHI_7B,
    "small": {**MOSHI_7B, "dim": 1024, "num_heads": 16, "num_layers": 8, "depformer_dim": 512,
              "depformer_num_layers": 4},
    "tiny": {**MOSHI_7B, "dim": 128, "num_heads": 4, "num_layers": 2, "depformer_dim": 64, "depformer_num_heads": 4,
             "depformer_num_layers": 2, "depformer_dim_feedforward": 256, "context": 250},
}  # fmt: skip


def random_moshi(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> MoshiLM:
    """Moshi's architecture at `shape` with random weights, made on `device` (normal(0, 0.02), norms at one)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = MoshiLM(MoshiConfig.from_kyutai(SHAPES[shape])).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    return model.eval().requires_grad_(False)


def run_level(model: MoshiLM, tok: MimiTokenizer, n: int, seconds: float, kv_budget: int | None) -> dict:
    config = EngineConfig(max_conversations=n, kv_budget_bytes=kv_budget, num_pages=None if kv_budget else 4096,
                          calibration_ticks=0, admission_headroom=float("inf"))  # fmt: skip
    engine = Engine(model, tok, config)
    rng = np.random.default_rng(n)
    cids = [engine.open("duplex", sampling=SamplingParams(seed=i), admit=False) for i in range(n)]
    frame, tick_s = tok.frame_size, engine.cfg.tick_s
    ticks, start = [], time.perf_counter()
    for t in range(round(seconds / tick_s)):
        for cid in cids:
            engine.push_audio(cid, (0.1 * rng.standard_normal(frame)).astype(np.float32))
        t0 = time.perf_counter()
        engine.step()
        ticks.append(time.perf_counter() - t0)
        for cid in cids:  # the clients read their audio
            q = engine.event_queue(cid)
            while not q.empty():
                q.get_nowait()
        time.sleep(max(0.0, start + (t + 1) * tick_s - time.perf_counter()))
    misses = [engine.sessions[c].deadline_misses for c in cids]
    return {
        "conversations": n,
        "kept": sum(m == 0 for m in misses),
        "misses": sum(misses),
        "tick_ms": percentiles(ticks[len(ticks) // 5 :], 1e3),  # (after the first fifth: warm-up)
        "tick_s": tick_s,
    }


@torch.no_grad()
def kyutai_step_ms(shape: str, device: torch.device, dtype: torch.dtype, steps: int = 50) -> float | None:
    """Kyutai's `LMGen.step` at batch 1 for `shape` (Kyutai's own random init), ms a step after 10 warm-up steps;
    None where the `moshi` package does not import."""
    try:
        from moshi.models.lm import LMGen, LMModel
    except ImportError:
        return None
    lm = LMModel(device=device, dtype=dtype, **SHAPES[shape]).eval()
    gen = LMGen(lm, temp=0.8, temp_text=0.7)
    user = torch.zeros(1, lm.n_q - lm.dep_q, 1, dtype=torch.long, device=device)
    times = []
    with gen.streaming(1):
        for _ in range(10 + steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            gen.step(user)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times[10:]))


def main() -> None:
    p = parser("moshi-scale", __doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--levels", default="1,2,4")
    p.add_argument("--seconds", type=float, default=10.0)
    add_device_args(p)
    p.add_argument("--dtype", default="auto", help="auto: bf16 on a GPU, fp32 on a CPU")
    args = p.parse_args()
    device, dtype = placement(args.device, args.dtype)
    levels = [1, 2] if args.quick else [int(x) for x in args.levels.split(",")]
    model = random_moshi(args.shape, device, dtype)
    tok = MimiTokenizer.random(None, seed=0, num_codebooks=model.moshi.dep_q, device=device)
    budget = None
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(0.85 * free)
    rows = [run_level(model, tok, n, 3.0 if args.quick else args.seconds, budget) for n in levels]
    del model
    kyutai = kyutai_step_ms(args.shape, device, dtype)
    env = environment()
    for r in rows:
        r.update(shape=args.shape, device=str(device), dtype=str(dtype).removeprefix("torch."), env=env)
        r["kyutai_step_ms"] = kyutai
    columns = [("conversations", "N"), ("kept", "kept in real time"), ("misses", "deadline misses"),
               ("tick_p50", "tick p50 ms"), ("tick_p95", "tick p95 ms")]  # fmt: skip
    for r in rows:
        r["tick_p50"], r["tick_p95"] = f"{r['tick_ms']['p50']:.1f}", f"{r['tick_ms']['p95']:.1f}"
    kyutai_note = f"{kyutai:.1f} ms" if kyutai is not None else "n/a (moshi not installed)"
    title = (
        f"Moshi {args.shape} (random {str(dtype).removeprefix('torch.')} weights, Mimi full size) on {device}; "
        f"Kyutai's LMGen.step at batch 1: {kyutai_note}"
    )
    table = print_table(title, rows, columns)
    save_outputs(args, rows, table)


if __name__ == "__main__":
    main()
