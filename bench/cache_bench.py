"""Cache benchmark: cost of match, insert and evict per step of key, from 10^3 to 10^6 cached steps, per mode.

    s2s bench cache [--quick] [--json PATH] [--plot PATH]

The pool holds the cached steps plus one conversation, so every new conversation runs where the engine does once
memory is full: match its key, lock, evict the least recently used pages it needs, allocate, insert, close. Keys are
a prompt (one of 16, 256 steps) then 256 steps of their own, each step 8 codes (K = 4 codebooks, both streams), pages
of 16 steps. Measured conversations all start with prompt 0, which a live conversation keeps locked, so each hits
256 steps and misses 256 whatever the tree size. Per measured conversation: `match` and `insert` in microseconds per
key step, `evict` in microseconds per evicted step; a full run keeps the best of 3 rounds. A second table matches
keys of growing length against the largest tree: match cost must follow the key length, not the tree size. naive and
paged cache nothing; one row each shows the floor (key checks, counters).
"""

from __future__ import annotations

import math
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from bench.common import environment, parser, percentiles, print_table, save_outputs
from cache import PagePool, make_cache

PAGE, WIDTH, PROMPTS, PROMPT_STEPS, TAIL_STEPS = 16, 8, 16, 256, 256
KEY_STEPS = PROMPT_STEPS + TAIL_STEPS


class Workload:
    """Keys sharing prompts; `key()` is a new conversation's key, `long_keys` reach deep into the tree."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.prompts = [self.rng.integers(0, 1024, size=(PROMPT_STEPS, WIDTH)) for _ in range(PROMPTS)]

    def key(self, prompt: int | None = None) -> np.ndarray:
        """A new conversation's key: the given prompt (a random one if None), then steps of its own."""
        prompt = self.rng.integers(0, PROMPTS) if prompt is None else prompt
        return np.concatenate([self.prompts[prompt], self.rng.integers(0, 1024, size=(TAIL_STEPS, WIDTH))])


def serve(c, key: np.ndarray) -> dict[str, float]:
    """One conversation through the cache as the engine would run it; returns the timed parts, in seconds."""
    t0 = time.perf_counter()
    m = c.match(key)
    t1 = time.perf_counter()
    c.lock(m.handle)
    need = math.ceil(len(key) / PAGE) - len(m.pages)
    short = need - c.pool.num_free
    t2 = time.perf_counter()
    evicted = c.evict(short) if short > 0 else 0
    t3 = time.perf_counter()
    own = c.alloc(need)
    table = m.pages + own
    t4 = time.perf_counter()
    h = c.insert(key, table)
    t5 = time.perf_counter()
    c.lock(h)
    c.unlock(m.handle)
    c.release(own)
    c.unlock(h)
    return {"match": t1 - t0, "insert": t5 - t4, "evict": t3 - t2, "evicted_steps": evicted * PAGE}


def fill(mode: str, cached_steps: int, seed: int):
    """A cache whose pool is full: `cached_steps` of cached pages plus room for one conversation. Prompt 0 stays
    cached, locked as a live conversation would, so measured keys on it hit the same 256 steps at every size."""
    pool = PagePool(1, 1, 1, page_size=PAGE, num_pages=cached_steps // PAGE + KEY_STEPS // PAGE + 1)
    c = make_cache(mode, pool)
    work = Workload(seed)
    if mode in ("exact", "radix"):
        pages = c.alloc(PROMPT_STEPS // PAGE)
        c.lock(c.insert(work.prompts[0], pages))
        c.release(pages)
    while c.stats().cached_evictable < cached_steps // PAGE and c.stats().evicted_pages == 0:
        serve(c, work.key())
    return c, work


def timings(runs: list[dict]) -> dict[str, float]:
    out = {}
    for op in ("match", "insert"):
        p = percentiles([r[op] for r in runs], 1e6 / KEY_STEPS)
        out |= {
            f"{op}_us_per_step_p50": p["p50"],
            f"{op}_us_per_step_p99": p["p99"],
            f"{op}_us_p50": p["p50"] * KEY_STEPS,
        }
    evicting = [r for r in runs if r["evicted_steps"]]
    if evicting:
        p = percentiles([r["evict"] * 1e6 / r["evicted_steps"] for r in evicting])
        out |= {"evict_us_per_step_p50": p["p50"], "evict_us_per_step_p99": p["p99"]}
        out["evict_us_p50"] = percentiles([r["evict"] for r in evicting], 1e6)["p50"]
    return out


def scaling_row(mode: str, cached_steps: int, repeats: int, rounds: int) -> dict:
    """`rounds` fresh caches of `repeats` conversations each; every figure is the best round's, the one least
    disturbed by other load on the machine."""
    rounds_timings = []
    for r in range(rounds):
        c, work = fill(mode, cached_steps, seed=cached_steps + r)
        before = c.stats()
        rounds_timings.append(timings([serve(c, work.key(prompt=0)) for _ in range(repeats)]))
        c.check()
        s = c.stats()
        hits = s.hit_steps - before.hit_steps
    return {
        "bench": "scaling",
        "mode": mode,
        "target_cached_steps": cached_steps,
        "cached_steps": (s.cached_evictable + s.cached_locked) * PAGE,
        "pool_pages": c.pool.num_usable,
        "page_size": PAGE,
        "step_width": WIDTH,
        "key_steps": KEY_STEPS,
        "prompt_steps": PROMPT_STEPS,
        "prompts": PROMPTS,
        "repeats": repeats,
        "rounds": rounds,
        "hit_rate": hits / (hits + s.missed_steps - before.missed_steps),
        **{k: min(t[k] for t in rounds_timings) for k in rounds_timings[0]},
    }


def key_length_rows(mode: str, cached_steps: int, lengths: list[int], repeats: int) -> list[dict]:
    """Match keys of each length against a full tree of `cached_steps`; the keys' prefixes are all cached."""
    c, work = fill(mode, cached_steps, seed=cached_steps + 1)
    longest = np.concatenate([work.prompts[0], work.rng.integers(0, 1024, size=(max(lengths), WIDTH))])
    pages = c.alloc(math.ceil(len(longest) / PAGE))  # room was made by evicting: this key is now cached and held
    c.insert(longest, pages)
    rows = []
    for n in lengths:
        key = np.concatenate([longest[:n], work.rng.integers(0, 1024, size=(1, WIDTH))])
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            m = c.match(key)
            times.append(time.perf_counter() - t)
        assert m.cached_steps == n
        p = percentiles(times, 1e6)
        rows.append(
            {
                "bench": "key_length",
                "mode": mode,
                "cached_steps": (c.stats().cached_evictable + c.stats().cached_locked) * PAGE,
                "key_steps": n + 1,
                "hit_steps": n,
                "page_size": PAGE,
                "step_width": WIDTH,
                "repeats": repeats,
                "match_us_p50": p["p50"],
                "match_us_p99": p["p99"],
                "match_us_per_step_p50": p["p50"] / (n + 1),
            }
        )
    c.release(pages)
    return rows


def plot(scaling: list[dict], lengths: list[dict], path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, ls in (("radix", "-"), ("exact", "--")):
        rows = sorted((r for r in scaling if r["mode"] == mode), key=lambda r: r["cached_steps"])
        x = [r["cached_steps"] for r in rows]
        for op, color in (("match", "C0"), ("insert", "C1"), ("evict", "C2")):
            a.plot(x, [r.get(f"{op}_us_per_step_p50", np.nan) for r in rows], ls=ls, color=color, marker="o")
            a.plot([], [], ls=ls, color=color, label=f"{mode} {op}")
        rows = sorted((r for r in lengths if r["mode"] == mode), key=lambda r: r["key_steps"])
        b.plot([r["key_steps"] for r in rows], [r["match_us_p50"] for r in rows], ls=ls, marker="o", label=mode)
    a.set(xscale="log", yscale="log", ylim=(3e-3, 1), xlabel="cached steps", ylabel="µs per step (p50)")
    a.set_title("Cost per step vs tree size (match/insert: per key step; evict: per evicted step)", fontsize=8)
    a.legend(fontsize=7, ncol=2, loc="upper left")
    ks = sorted({r["key_steps"] for r in lengths})
    ref = next(r["match_us_p50"] for r in lengths if r["mode"] == "radix" and r["key_steps"] == ks[0])
    b.plot(ks, [ref * k / ks[0] for k in ks], color="gray", lw=1, ls=":", label="∝ key length")
    b.set(xscale="log", yscale="log", xlabel="key steps", ylabel="match µs per call (p50)")
    b.set_title(f"match vs key length, {lengths[0]['cached_steps']:.0e} cached steps", fontsize=8)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parser("cache", __doc__.splitlines()[0]).parse_args(argv)
    sizes = [10**3, 10**4, 10**5] if args.quick else [10**3, 10**4, 10**5, 10**6]
    repeats, rounds = (100, 1) if args.quick else (300, 3)
    lengths = [64, 256, 1024, 4096] if args.quick else [64, 256, 1024, 4096, 16384]
    env = {**environment(), "quick": args.quick}

    scaling = [scaling_row(mode, n, repeats, rounds) for mode in ("radix", "exact") for n in sizes]
    scaling += [scaling_row(mode, 0, repeats, rounds) for mode in ("paged", "naive")]
    by_length = [r for mode in ("radix", "exact") for r in key_length_rows(mode, sizes[-1], lengths, repeats // 10)]

    tables = print_table(
        f"Cost per step with a full pool (keys of {KEY_STEPS} steps: {PROMPT_STEPS} shared prompt + own tail)",
        scaling,
        [
            ("mode", "mode"),
            ("cached_steps", "cached steps"),
            ("hit_rate", "hit rate"),
            ("match_us_per_step_p50", "match µs/step p50"),
            ("match_us_per_step_p99", "match µs/step p99"),
            ("insert_us_per_step_p50", "insert µs/step p50"),
            ("insert_us_per_step_p99", "insert µs/step p99"),
            ("evict_us_per_step_p50", "evict µs/evicted step p50"),
            ("evict_us_per_step_p99", "evict µs/evicted step p99"),
            ("match_us_p50", "match µs/call p50"),
        ],
    )
    tables += print_table(
        f"match vs key length, {by_length[0]['cached_steps']} cached steps (whole key cached but its last step)",
        by_length,
        [
            ("mode", "mode"),
            ("key_steps", "key steps"),
            ("match_us_p50", "match µs/call p50"),
            ("match_us_p99", "match µs/call p99"),
            ("match_us_per_step_p50", "match µs/step p50"),
        ],
    )
    for mode in ("radix", "exact"):
        rows = [r for r in scaling if r["mode"] == mode]
        ratio = rows[-1]["match_us_per_step_p50"] / rows[0]["match_us_per_step_p50"]
        line = (
            f"{mode}: match per step at {rows[-1]['cached_steps']} cached steps / at {rows[0]['cached_steps']}: "
            f"{ratio:.2f}x for {rows[-1]['cached_steps'] / rows[0]['cached_steps']:.0f}x the tree"
        )
        print(line)
        tables.append(f"- {line}")
    plot(scaling, by_length, args.plot)
    save_outputs(args, [{**env, **r} for r in scaling + by_length], tables)


if __name__ == "__main__":
    main()
