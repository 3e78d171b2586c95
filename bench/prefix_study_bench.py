"""Prefix study: how long are the exact shared code prefixes between encodings of one sentence, and what of them a
radix cache can reuse.

    s2s bench prefix-study [--quick] [--json PATH] [--plot PATH] [--codec DIR]

One sentence is spoken by espeak-ng in several voices and speeds. The base take (en-us, 150 words a minute) is also
shifted by k samples (k zeros in front; k = 0 encodes the same waveform a second time), mixed with seeded white noise
at a few SNRs (against the take's mean power, clipped to [-1, 1]), and sent through the codec and back (encode ->
decode -> encode). Everything is encoded offline at 6 kbps (8 codebooks); by residual quantization the first 2 are
the 1.5 kbps codes the engine runs on (the run checks it). For each pair of encodings: the exact common prefix in
frames, per codebook and for whole frames (a step token needs every codebook equal); the fraction of frames equal
position by position (over the shorter take), beside chance (the collision rate of the two code histograms, what
unrelated frames would give). The radix part builds each take's prefix key as the engine does for a turn-mode user
turn (`Session`: user codes under the delay pattern, model stream silent), inserts one key into a `RadixCache`
(pages of 16 steps) and matches the other. Without `--codec` the codec has seeded random weights: its codes are not
the real EnCodec's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm

from bench.common import RESULTS_DIR, environment, parser, print_table, save_outputs
from cache import PagePool, RadixCache
from codec import EncodecTokenizer
from s2s import ModelConfig, SamplingParams
from s2s.engine.session import Session
from speech.sample import synthesize

SENTENCE = "Could you book a table for two at the Italian place near the station tonight?"
PROMPT_SENTENCE = "Hi, I am your assistant."  # a voice prompt: another sentence in another voice
NEXT_SENTENCE = "Thanks, and please remind me an hour before."  # the user's next turn
BASE_VOICE, BASE_WPM = "en-us", 150
FRAME = EncodecTokenizer.frame_size  # samples per frame of the codec studied
SHIFTS = (0, 1, FRAME // 4, FRAME // 2, FRAME)
PAGE = 16
BANDWIDTH, ENGINE_BANDWIDTH = 6.0, 1.5  # codes at 6 kbps; their first codebooks are the 1.5 kbps codes
WIDE, NARROW = 8, 2  # codebooks at those bandwidths


@dataclass
class Take:
    """One encoding: what was spoken and how (voice, words a minute), what was done to it, its codes `[K, F]`."""

    name: str
    voice: str
    wpm: int
    codes: np.ndarray
    shift: int | None = None  # samples of silence put in front of the base waveform


# ---- measures ----------------------------------------------------------------------------------------------------


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Leading positions where `a` and `b` are equal: `[F]` arrays compare elements, `[F, W]` arrays whole rows."""
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim != b.ndim or a.ndim not in (1, 2) or a.shape[1:] != b.shape[1:]:
        raise ValueError(f"compare two [F] or two [F, W] arrays of the same width, got {a.shape} and {b.shape}")
    n = min(len(a), len(b))
    same = a[:n] == b[:n]
    if same.ndim == 2:
        same = same.all(axis=1)
    return n if same.all() else int(np.argmin(same))


def prefix_frames(a: np.ndarray, b: np.ndarray) -> dict[str, int]:
    """Common prefix of codes `[K, F]` per codebook (`cb0`..) and for the first 2 and 8 codebooks together."""
    out = {f"cb{k}": common_prefix(a[k], b[k]) for k in range(len(a))}
    for k in (NARROW, WIDE):
        out[f"all{k}"] = common_prefix(a[:k].T, b[:k].T)
    return out


def equal_fraction(a: np.ndarray, b: np.ndarray, skip: int = 0) -> dict[str, float]:
    """Fraction of frames equal position by position (over the shorter take), per codebook and for 2 and 8 together;
    `skip` drops that many leading frames of `b` first (re-aligning a take that starts later)."""
    b = b[:, skip:]
    n = min(a.shape[1], b.shape[1])
    same = a[:, :n] == b[:, :n]
    out = {f"cb{k}": float(same[k].mean()) for k in range(len(a))}
    for k in (NARROW, WIDE):
        out[f"all{k}"] = float(same[:k].all(axis=0).mean())
    return out


def chance_equal(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """The position-wise equality two takes would show if their frames were unrelated: the collision probability
    of their code histograms, per codebook and for whole frames of 2 and 8 codebooks."""

    def collide(x: np.ndarray, y: np.ndarray) -> float:  # x, y: [F, W]
        xs, xc = np.unique(x, axis=0, return_counts=True)
        ys, yc = np.unique(y, axis=0, return_counts=True)
        py = {r.tobytes(): c / len(y) for r, c in zip(ys, yc, strict=True)}
        return float(sum(c / len(x) * py.get(r.tobytes(), 0.0) for r, c in zip(xs, xc, strict=True)))

    out = {f"cb{k}": collide(a[k : k + 1].T, b[k : k + 1].T) for k in range(len(a))}
    for k in (NARROW, WIDE):
        out[f"all{k}"] = collide(a[:k].T, b[:k].T)
    return out


def turn_key(codes: np.ndarray, cfg: ModelConfig, prompt: np.ndarray | None = None) -> np.ndarray:
    """The engine's prefix key for a turn-mode user turn `[K, F]`, after an optional voice prompt `[K, P]`."""
    conv = Session("study", "turn", cfg, SamplingParams(), row=0, now=0.0, frame_size=FRAME)
    if prompt is not None:
        conv.set_prompt(prompt)
    conv.add_user_frames(codes)
    return conv.key(conv.user_frames)


def radix_reuse(cached: np.ndarray, key: np.ndarray) -> int:
    """Steps of `key` a radix cache holding only `cached` gives back: whole pages of `PAGE` steps and the steps of a
    partly matching page (which the engine copies), never the key's last step."""
    pool = PagePool(1, 1, 1, page_size=PAGE, num_pages=len(cached) // PAGE + 2)
    cache = RadixCache(pool)
    pages = cache.alloc(len(cached) // PAGE)
    cache.insert(cached, pages)
    cache.release(pages)
    m = cache.match(key)
    return m.cached_steps + (m.partial[1] if m.partial else 0)


# ---- takes -------------------------------------------------------------------------------------------------------


def speak(text: str, voice: str, wpm: int) -> np.ndarray:
    return synthesize(text, voice=voice, words_per_minute=wpm)


def with_noise(wav: np.ndarray, snr_db: float, seed: int) -> np.ndarray:
    noise = np.random.default_rng(seed).standard_normal(len(wav)).astype(np.float32)
    noise *= np.sqrt(np.mean(wav**2) / 10 ** (snr_db / 10))
    return np.clip(wav + noise, -1.0, 1.0)


def encode(tok: EncodecTokenizer, wav: np.ndarray) -> np.ndarray:
    return tok.encode(wav)[0].numpy()


def encode_streaming(tok: EncodecTokenizer, wav: np.ndarray, block: int = 1920) -> np.ndarray:
    """Codes from the streaming encoder fed `block` samples at a time (80 ms: what a client sends)."""
    enc = tok.streaming_encoder(1)
    return torch.cat([enc.push(wav[None, a : a + block])[0] for a in range(0, len(wav), block)], dim=1).numpy()


def encode_threads(tok: EncodecTokenizer, wav: np.ndarray, threads: int) -> np.ndarray:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return encode(tok, wav)
    finally:
        torch.set_num_threads(before)


def takes(tok: EncodecTokenizer, narrow: EncodecTokenizer, quick: bool) -> tuple[list[Take], list[Take], list[str]]:
    """The re-spoken takes (voices x speeds), the takes derived from the base waveform, and notes (dropped voices)."""
    if quick:
        voices, speeds, snrs, trips = ["en-gb", "en-us+f2"], [("en-us", 180)], (10,), [(narrow, ENGINE_BANDWIDTH)]
    else:
        voices = ["en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-us-nyc", "en-us+m3", "en-us+f2", "en+m3"]
        voices += ["en+f2"]
        speeds = [("en-us", w) for w in (120, 135, 165, 180)] + [("en+f2", w) for w in (120, 180)]
        snrs, trips = (40, 30, 20, 10), [(narrow, ENGINE_BANDWIDTH), (tok, BANDWIDTH)]
    spoken = [(BASE_VOICE, BASE_WPM), *((v, BASE_WPM) for v in voices), *speeds]  # the base take first
    notes, seen, respoken = [], {}, []
    for voice, wpm in tqdm(spoken, desc="re-spoken takes"):
        wav = speak(SENTENCE, voice, wpm)
        twin = next((n for n, w in seen.items() if np.array_equal(w, wav)), None)
        if twin:  # e.g. espeak-ng ignores a +variant after en-gb: a byte-identical take would be a false "re-spoken"
            notes.append(f"{voice} at {wpm} wpm gave the same audio bytes as {twin}: left out of the re-spoken takes")
            continue
        seen[f"{voice} {wpm}"] = wav
        respoken.append(Take(f"{voice} {wpm}", voice, wpm, encode(tok, wav)))

    base, base_codes = seen[f"{BASE_VOICE} {BASE_WPM}"], respoken[0].codes
    if not np.array_equal(encode(narrow, base), base_codes[:NARROW]):
        raise RuntimeError("the 1.5 kbps codes are not the first 2 codebooks of the 6 kbps codes: the study's premise")

    def take(name: str, codes: np.ndarray, shift: int | None = None) -> Take:
        return Take(name, BASE_VOICE, BASE_WPM, codes, shift)

    derived = []  # shift 0 first: the same waveform encoded a second time
    for k in SHIFTS:
        shifted = np.concatenate([np.zeros(k, np.float32), base])
        name = f"base vs shifted by {k} samples" if k else "same waveform encoded again (shift 0)"
        derived.append(take(name, encode(tok, shifted), shift=k))
    derived.append(take("same waveform, streaming encoder, 80 ms blocks", encode_streaming(tok, base)))
    beside = tok.encode(np.stack([base, base[::-1].copy()]))[0].numpy()
    derived.append(take("same waveform, batched beside another row", beside))
    derived.append(take("same waveform, 2 torch threads", encode_threads(tok, base, 2)))
    for snr in snrs:
        derived.append(take(f"base vs noise {snr} dB", encode(tok, with_noise(base, snr, seed=snr))))
    for t, bw in trips:
        audio = t.decode(torch.from_numpy(base_codes[: t.num_codebooks])[None])[0].clamp(-1, 1).numpy()
        derived.append(take(f"base vs codec round trip {bw:g} kbps", encode(tok, audio)))
    return respoken, derived, notes


# ---- pairs -------------------------------------------------------------------------------------------------------


def relation(a: Take, b: Take) -> str:
    if a.voice == b.voice:
        return "re-spoken: other speed"
    return "re-spoken: other voice" if a.wpm == b.wpm else "re-spoken: other voice and speed"


def pair_row(rel: str, a: Take, b: Take, keys: dict[int, dict[str, np.ndarray]]) -> dict:
    row = {"bench": "pair", "relation": rel, "a": a.name, "b": b.name, "frames_a": a.codes.shape[1]}
    row["frames_b"] = b.codes.shape[1]
    row |= {f"prefix_{k}": v for k, v in prefix_frames(a.codes, b.codes).items()}
    row |= {f"equal_{k}": v for k, v in equal_fraction(a.codes, b.codes).items()}
    row |= {f"chance_{k}": v for k, v in chance_equal(a.codes, b.codes).items()}
    if b.shift is not None:
        realigned = equal_fraction(a.codes, b.codes, skip=b.shift // FRAME)
        row |= {f"equal_realigned_{k}": v for k, v in realigned.items()}
    for k in (NARROW, WIDE):
        key_a, key_b = keys[k][a.name], keys[k][b.name]
        row[f"radix_hit_steps_{k}"] = radix_reuse(key_a, key_b)
        row[f"key_steps_{k}"] = len(key_b)
    return row


def scenario_rows(respoken: list[Take], derived: list[Take], tok: EncodecTokenizer, cfgs: dict) -> list[dict]:
    """Radix reuse where the audio bytes repeat: a replayed voice prompt, a session's next turn (its history)."""
    base = respoken[0]
    prompt = encode(tok, speak(PROMPT_SENTENCE, "en-us+f2", BASE_WPM))
    other = encode(tok, speak(NEXT_SENTENCE, "en-gb", BASE_WPM))
    rows = []
    for k, cfg in cfgs.items():
        p, turn = prompt[:k], base.codes[:k]
        cases = [  # (scenario, the cached key, the new key, voice prompt frames)
            ("same voice prompt, then other speech", turn_key(turn, cfg, p), turn_key(other[:k], cfg, p), p.shape[1]),
            (
                "next turn: cached turn + new speech",
                turn_key(turn, cfg),
                turn_key(np.concatenate([turn, other[:k]], axis=1), cfg),
                0,
            ),
            ("same audio bytes, encoded again", turn_key(turn, cfg), turn_key(derived[0].codes[:k], cfg), 0),
        ]
        for name, cached, key, prompt_frames in cases:
            rows.append(
                {
                    "bench": "scenario",
                    "scenario": name,
                    "codebooks": k,
                    "prompt_frames": prompt_frames,
                    "key_steps": len(key),
                    "shared_steps": common_prefix(cached, key),
                    "radix_hit_steps": radix_reuse(cached, key),
                }
            )
    return rows


# ---- report ------------------------------------------------------------------------------------------------------


BOOKS = [*(f"cb{i}" for i in range(WIDE)), f"all{NARROW}", f"all{WIDE}"]  # per codebook, then whole frames


def summary(rel: str, rows: list[dict]) -> dict:
    """One table row per relation: p50 (and max, where the pairs differ) of each figure over its pairs."""
    out = {"relation": rel, "pairs": len(rows), "frames": int(np.median([r["frames_b"] for r in rows]))}

    def p50(key: str) -> float:
        return float(np.median([r[key] for r in rows]))

    def cell(key: str) -> str:
        v = [r[key] for r in rows]
        return f"{np.median(v):.0f}" if min(v) == max(v) else f"{np.median(v):.0f} (max {max(v)})"

    for k in BOOKS:
        out[f"prefix_{k}"] = cell(f"prefix_{k}")
        out[f"equal_{k}"] = f"{100 * p50(f'equal_{k}'):.1f} / {100 * p50(f'chance_{k}'):.1f}"
        if f"equal_realigned_{k}" in rows[0]:
            out[f"equal_realigned_{k}"] = f"{100 * p50(f'equal_realigned_{k}'):.1f}"
    for k in (NARROW, WIDE):
        out[f"radix_{k}"] = cell(f"radix_hit_steps_{k}")
        out[f"key_{k}"] = int(p50(f"key_steps_{k}"))
    return out


def usage_row(take: Take, codebook_size: int) -> dict:
    """How many distinct codes (and whole frames) a take uses: few means frames collide by chance."""
    row = {"bench": "usage", "take": take.name, "frames": take.codes.shape[1], "codebook_size": codebook_size}
    row |= {f"distinct_cb{i}": len(np.unique(take.codes[i])) for i in range(WIDE)}
    for k in (NARROW, WIDE):
        row[f"distinct_all{k}"] = len(np.unique(take.codes[:k].T, axis=0))
    return row


def tables(pairs: list[dict], scenarios: list[dict], usage: dict, codec_note: str) -> list[str]:
    rels = list(dict.fromkeys(r["relation"] for r in pairs))
    summ = [summary(rel, [r for r in pairs if r["relation"] == rel]) for rel in rels]
    heads = [(k, k.replace("all", "all ")) for k in BOOKS]
    md = print_table(
        f"Exact common prefix, frames: p50 (max) over pairs; all 2 / all 8 = whole frames at 1.5 / 6 kbps "
        f"({codec_note})",
        summ,
        [("relation", "relation"), ("pairs", "pairs"), ("frames", "frames")] + [(f"prefix_{k}", h) for k, h in heads],
    )
    md += print_table(
        "Frames equal position by position, % (p50 over pairs) / chance % (the code histograms' collision rate)",
        summ,
        [("relation", "relation")]
        + [(f"equal_{k}", h) for k, h in heads]
        + [("equal_realigned_all2", "all 2 after k // frame"), ("equal_realigned_all8", "all 8 after k // frame")],
    )
    md += print_table(
        f"Distinct codes in the base take (of {usage['codebook_size']} per codebook), {usage['frames']} frames",
        [usage],
        [(f"distinct_{k}", h) for k, h in heads],
    )
    md += print_table(
        f"Radix cache reuse of a turn-mode key (pages of {PAGE} steps): steps matched, p50 (max) over pairs",
        summ,
        [("relation", "relation"), ("key_2", "key steps, 1.5 kbps"), ("radix_2", "reused, 1.5 kbps")]
        + [("key_8", "key steps, 6 kbps"), ("radix_8", "reused, 6 kbps")],
    )
    md += print_table(
        f"Radix cache reuse where audio bytes repeat (pages of {PAGE} steps)",
        [r | {"reused_pct": 100.0 * r["radix_hit_steps"] / r["key_steps"]} for r in scenarios],
        [("scenario", "scenario"), ("codebooks", "codebooks"), ("prompt_frames", "prompt frames")]
        + [("key_steps", "key steps"), ("shared_steps", "shared steps"), ("radix_hit_steps", "reused steps")]
        + [("reused_pct", "reused % of key")],
    )
    return md


def plot(pairs: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1, 1.2]})
    respoken = [r for r in pairs if r["relation"].startswith("re-spoken")]
    cmap = plt.get_cmap("viridis")
    for i in range(WIDE):
        v = np.sort([r[f"prefix_cb{i}"] for r in respoken])
        a.step(v, np.arange(1, len(v) + 1) / len(v), where="post", color=cmap(i / WIDE), label=f"codebook {i}")
    for k, ls in ((NARROW, "--"), (WIDE, ":")):
        v = np.sort([r[f"prefix_all{k}"] for r in respoken])
        a.step(v, np.arange(1, len(v) + 1) / len(v), where="post", color="k", ls=ls, label=f"whole frame, {k} books")
    a.set(xlabel="exact common prefix (frames, 13.3 ms each)", ylabel="fraction of pairs <= x")
    a.set_title(f"Same sentence re-spoken (other voice/speed): {len(respoken)} pairs", fontsize=9)
    a.legend(fontsize=7)
    groups = {"re-spoken (all)": respoken}
    for r in pairs:
        if not r["relation"].startswith("re-spoken"):
            groups.setdefault(r["relation"], []).append(r)
    for j, (name, rows) in enumerate(groups.items()):
        mean = [100 * np.mean([r[f"equal_cb{i}"] for r in rows]) for i in range(WIDE)]
        b.plot(range(WIDE), mean, marker="o", color=plt.get_cmap("tab20")(j % 20), label=name)
    chance = [100 * np.mean([r[f"chance_cb{i}"] for r in respoken]) for i in range(WIDE)]
    b.plot(range(WIDE), chance, color="k", ls="--", label="chance, re-spoken pairs (code histograms)")
    b.set(xlabel="codebook", ylabel="frames equal position-wise (%)", ylim=(-2, 102))
    b.set_title("Position-wise equality per codebook (mean over pairs)", fontsize=9)
    b.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = parser("prefix-study", __doc__.splitlines()[0])
    p.add_argument("--codec", type=Path, default=None, help="Hugging Face EnCodec 24 kHz folder (default: seeded)")
    p.set_defaults(plot=RESULTS_DIR / "prefix_study.png")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # codes, not time, are measured; one thread runs the codec fastest on a busy machine
    tok = EncodecTokenizer.from_pretrained(args.codec, bandwidth=BANDWIDTH)
    narrow = EncodecTokenizer(tok.model, ENGINE_BANDWIDTH)  # the same weights, 2 codebooks
    codec_note = f"EnCodec checkpoint {args.codec}" if args.codec else "seeded random EnCodec: not the real codes"
    print(f"codec: {codec_note}; sentence: {SENTENCE!r}")

    respoken, derived, notes = takes(tok, narrow, args.quick)
    cfgs = {k: ModelConfig.preset("tiny", num_codebooks=k) for k in (NARROW, WIDE)}
    keys = {k: {t.name: turn_key(t.codes[:k], cfg) for t in respoken + derived} for k, cfg in cfgs.items()}
    base = respoken[0]
    pairs = [pair_row(relation(a, b), a, b, keys) for a, b in itertools.combinations(respoken, 2)]
    pairs += [pair_row(t.name, base, t, keys) for t in derived]
    scenarios = scenario_rows(respoken, derived, tok, cfgs)

    usage = usage_row(base, tok.codebook_size)
    md = tables(pairs, scenarios, usage, codec_note)
    for n in notes:
        print(n)
        md.append(f"- {n}")
    plot(pairs, args.plot)
    env = {
        **environment(),
        "quick": args.quick,
        "codec": str(args.codec) if args.codec else "seeded",
        "page_size": PAGE,
    }
    env |= {"sentence": SENTENCE, "base_voice": BASE_VOICE, "base_wpm": BASE_WPM}
    save_outputs(args, [{**env, **r} for r in [*pairs, *scenarios, usage]], md)


if __name__ == "__main__":
    main()
