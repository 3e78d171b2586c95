"""Reply-end benchmark: do turn replies end, in voices, rates and levels the oracle does not use?

    s2s bench reply-end [--quick] [--models DIR,DIR] [--sentences 2] [--temperatures 0,0.8] [--json PATH]

Each model (default: the shipped echo; give the code before's weights too, to compare in one run) answers turns on
the shipped codec, in-process, 8 conversations at a time: a held-out sentence in each of 16 voices (flite's 4,
festival's HTS voice, espeak-ng's male and female variants in 6 accents, 110 to 180 words a minute; some are training
voices, some not), each at full level and 20 dB down. A reply ended when its `reply_done` came within the
question's length and a second of reply audio, with nothing after it (the engine runs on for 300 frames past the
question). Also: the share of replies the oracle hears as their sentence, against the originals' share.
"""

from __future__ import annotations

import numpy as np

from bench.common import environment, parser, print_table, save_outputs
from codec import EncodecTokenizer
from codec.pcm import SAMPLE_RATE
from s2s import Engine, EngineConfig, S2SModel, SamplingParams
from s2s.engine.events import AudioEvent, MetaEvent
from s2s.models.shipped import shipped
from speech import oracle
from speech.sentences import HELDOUT_SENTENCES
from speech.voices import TRAIN_VOICES, Voice, say

VOICES = [Voice("flite", n) for n in ("awb", "rms", "slt", "kal")] + [Voice("festival", "voice_cmu_us_slt_arctic_hts")]
VOICES += [
    Voice("espeak", name, wpm)
    for name, wpm in [
        ("en-us+m3", 110),
        ("en+m1", 180),
        ("en-gb-x-rp+m2", 130),
        ("en-gb+f3", 130),
        ("en-us+f3", 130),
        ("en-us+f5", 160),
        ("en-gb-scotland+m4", 140),
        ("en-029+f2", 120),
        ("en-us+m7", 170),
        ("en+klatt3", 150),
        ("en-us+f4", 130),
    ]
]
GAINS = (1.0, 0.1)
AT_ONCE = 8
LISTEN_FRAMES = 300  # frames the engine runs on past a question, waiting for its reply to end


def questions(sentences: int) -> list[dict]:
    out = []
    for s in range(sentences):
        for v, voice in enumerate(VOICES):
            index = (s * 7 + v * 3) % len(HELDOUT_SENTENCES)
            pcm = say(HELDOUT_SENTENCES[index], voice)
            trained = Voice(voice.engine, voice.name) in TRAIN_VOICES
            out += [dict(voice=str(voice), trained=trained, gain=g, pcm=pcm * g, index=index) for g in GAINS]
    return out


def answer(model: S2SModel, tok: EncodecTokenizer, qs: list[dict], temperature: float) -> list[dict]:
    """Each question's reply: frames before `reply_done` (None: it never came), frames after it, and its audio."""
    cfg = EngineConfig(num_pages=2048, calibration_ticks=0, max_reply_frames=900, admission_headroom=float("inf"))
    engine, fs, out = Engine(model, tok, cfg), tok.frame_size, []
    for i in range(0, len(qs), AT_ONCE):
        batch = qs[i : i + AT_ONCE]
        cids = [
            engine.open("turn", sampling=SamplingParams(temperature=temperature, seed=i + j)) for j in range(len(batch))
        ]
        for a in range(0, max(len(q["pcm"]) for q in batch), 4 * fs):
            for cid, q in zip(cids, batch, strict=True):
                if a < len(q["pcm"]):
                    engine.push_audio(cid, q["pcm"][a : a + 4 * fs])
            engine.step()
        for cid in cids:
            engine.end_turn(cid)
        got = {cid: dict(audio=[], done=None, after=0) for cid in cids}
        for _ in range(LISTEN_FRAMES):
            engine.step()
            for cid in cids:
                queue, g = engine.event_queue(cid).queue, got[cid]
                while queue:
                    e = queue.popleft()
                    if isinstance(e, AudioEvent) and g["done"] is None:
                        g["audio"].append(np.asarray(e.pcm))
                    elif isinstance(e, AudioEvent):
                        g["after"] += len(e.pcm)
                    elif isinstance(e, MetaEvent) and e.data.get("event") == "reply_done" and g["done"] is None:
                        g["done"] = sum(len(x) for x in g["audio"])
            if all(g["done"] is not None for g in got.values()):
                break
        for cid, q in zip(cids, batch, strict=True):
            engine.discard(cid)
            g = got[cid]
            audio = np.concatenate(g["audio"]) if g["audio"] else np.zeros(1, np.float32)
            ended = g["done"] is not None and g["done"] <= len(q["pcm"]) + SAMPLE_RATE and not g["after"]
            out.append(dict(ended=ended, length=len(audio) / len(q["pcm"]), heard=heard(audio) == q["index"]))
    return out


def heard(pcm: np.ndarray) -> int | None:
    peak = float(np.abs(pcm).max())
    return oracle.heard(pcm * (0.9 / peak)) if peak > 0 else None


def main() -> None:
    p = parser("reply-end", __doc__.splitlines()[0])
    p.add_argument("--models", default=str(shipped("model")), help="model folders, comma-separated")
    p.add_argument("--sentences", type=int, default=2, help="held-out sentences per voice")
    p.add_argument("--temperatures", default="0,0.8", help="sampling temperatures, comma-separated")
    args = p.parse_args()
    if args.quick:
        args.sentences, args.temperatures = 1, "0"
    tok = EncodecTokenizer.from_pretrained(shipped("codec"))
    qs = questions(args.sentences)
    originals = [heard(q["pcm"]) == q["index"] for q in qs]
    rows = []
    for folder in args.models.split(","):
        model = S2SModel.from_pretrained(folder)
        for t in (float(x) for x in args.temperatures.split(",")):
            got = answer(model, tok, qs, t)
            for subset, keep in (("all", lambda q: True), ("trained voices", lambda q: q["trained"])):
                sel = [i for i, q in enumerate(qs) if keep(q)]
                rows.append(
                    {
                        "bench": "reply-end",
                        "model": folder,
                        "temperature": t,
                        "voices": subset,
                        "takes": len(sel),
                        "ended": float(np.mean([got[i]["ended"] for i in sel])),
                        "heard": float(np.mean([got[i]["heard"] for i in sel])),
                        "originals_heard": float(np.mean([originals[i] for i in sel])),
                        "reply_over_question": float(np.median([got[i]["length"] for i in sel])),
                        "not_ended": sorted(
                            {qs[i]["voice"] + f" x{qs[i]['gain']:g}" for i in sel if not got[i]["ended"]}
                        ),
                        **environment(),
                    }
                )
    columns = [
        ("model", "model"),
        ("temperature", "T"),
        ("voices", "voices"),
        ("takes", "takes"),
        ("ended", "replies ended"),
        ("heard", "heard"),
        ("originals_heard", "originals heard"),
        ("reply_over_question", "reply / question (median)"),
    ]
    tables = print_table("Turn replies that end: reply_done within the question and 1 s, nothing after", rows, columns)
    for r in rows:
        if r["not_ended"] and r["voices"] == "all":
            print(f"{r['model']} T={r['temperature']:g}: not ended: {', '.join(r['not_ended'])}")
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
