"""The shipped weights, heard by the oracle: pocketsphinx over a JSGF grammar of the 40 held-out sentences, spoken
by the 2 held-out voices (`speech/`), none of them seen in training.

    s2s bench oracle [--quick] [--json PATH] [--plot PATH]

Rows, each a recognition rate (the share of takes heard as their own sentence) and that rate over the originals'
rate on the same takes:
- the originals, clean;
- the codec's round trip, offline at each bandwidth, and streaming (80 ms blocks in, frame by frame out) at 1.5.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from bench.common import environment, parser, print_table, save_outputs
from codec import BANDWIDTHS, EncodecTokenizer
from s2s.weights import shipped
from speech import oracle


def row(what: str, takes: list[oracle.Take], audios: list[np.ndarray], originals: dict[int, bool]) -> dict:
    rate = oracle.rate(takes, audios)
    base = float(np.mean([originals[id(t)] for t in takes]))
    return {"what": what, "takes": len(takes), "rate": rate, "originals": base, "relative": rate / base}


def main() -> None:
    p = parser("oracle", __doc__.splitlines()[0])
    args = p.parse_args()
    takes = oracle.takes()
    originals = {id(t): oracle.heard(t.pcm) == t.index for t in takes}
    rows = [row("originals", takes, [t.pcm for t in takes], originals)]
    codec_takes = takes[::4] if args.quick else takes
    for bandwidth in (1.5,) if args.quick else BANDWIDTHS:
        tok = EncodecTokenizer.from_pretrained(shipped("codec"), bandwidth=bandwidth)
        audios = [oracle.offline_round_trip(tok, t.pcm) for t in codec_takes]
        rows.append(row(f"codec {bandwidth:g} kbps, offline", codec_takes, audios, originals))
    tok = EncodecTokenizer.from_pretrained(shipped("codec"), bandwidth=1.5)
    stream_takes = codec_takes[::2]
    audios = [oracle.streaming_round_trip(tok, t.pcm) for t in stream_takes]
    rows.append(row("codec 1.5 kbps, streaming", stream_takes, audios, originals))
    env = environment()
    for r in rows:
        r.update(env)
    columns = [
        ("what", "measured"),
        ("takes", "takes"),
        ("rate", "heard"),
        ("originals", "originals heard"),
        ("relative", "heard / originals"),
    ]
    tables = print_table("The oracle: held-out sentences and voices, heard by pocketsphinx (JSGF)", rows, columns)
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(rows) + 1))
    ax.barh([r["what"] for r in rows], [r["rate"] for r in rows])
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("share of takes heard as their own sentence")
    fig.tight_layout()
    fig.savefig(args.plot)
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
