"""The echo model's starting point: its circuit written into the weights, which training then tunes.

Replaying a turn is a copy by content (an induction head: at each step of the reply, find where the user said what
the model has just said, and say what the user said next), which a randomly initialised model finds late and
unreliably on this machine's budget. So the circuit is planted, from two facts about the codec's codes: what digital
silence encodes to (`quiet`) and which codes are loud (`loud`: seen mostly inside speech).

The residual stream holds named blocks (`Layout`), one unit vector per code, the same in both streams: the user's
codes (U0 U1) and the model's (M0 M1); the previous user frame (P0 P1) and codebook 0 two frames back (Q0); the
model's previous codebook 0 (N0); what to say next (O0 O1); the last loud user frame (L0 L1). Then flags: a
constant, the reserved ids, loudness. Every step enters with the same norm (see `_embeddings`), so that the norm
scales all steps alike: the "most recent" heads below use large weights, and the model wants float32.

- Layer 0: head 0 attends one step back by position (RoPE's fast pairs, from the constant) and writes the previous
  user frame into P and the model's previous codebook 0 into N0; head 1 attends two steps back and writes Q0;
  head 2 finds the most recent event, a loud or a silent user frame (`recent_loud`: 1 loud, -1 silent); head 3
  copies the most recent loud user frame into L. "Most recent" is a slow RoPE pair, steadily falling over about a
  thousand steps. The MLP clears step 0's P (its previous frame is its own).
- Layer 1: head 0 is the copy: the model's last frame and a half (M0 M1 N0) against the user's (P0 P1 Q0), at
  RoPE's slowest pairs, which barely turn over a turn; it writes the matched step's user frame into O. Head 2
  starts a reply: on the reply's first step it attends to the turn's onset (a loud frame whose most recent event
  was not loud) and writes it into O. Head 3 is the duplex echo: the user's frame 37 steps back while both streams
  carry codes, else at rest on step 0, where layer 0's MLP has cleared P: it then says nothing and flags that the
  echo waits. Head 1 attends evenly and takes away what the start head adds to O at rest. The MLP compares M with
  L: when the model has just said the turn's last loud frame, END is next.
- The output heads read O; while the model stream is silent (listening), or the duplex echo waits, the quiet code
  wins.

Because a step's codebook k holds frame t - k, the copy continues the turn's reply and the duplex echo alike.
"""

from __future__ import annotations

import numpy as np
import torch

from s2s.models.config import ModelConfig
from s2s.models.model import S2SModel

ROPE_THETA = 1e12
DUPLEX_DELAY = 38  # frames: the duplex echo's delay, about half a second
ECHO_CONFIG = dict(
    hidden_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=512,
    rope_theta=ROPE_THETA,
)
BLOCK = 24  # dimensions per code vector
BLOCKS = ["U0", "U1", "M0", "M1", "P0", "P1", "Q0", "Q1", "N0", "N1", "O0", "O1", "L0", "L1"]
USER_FLAGS = [
    "user0_silent",
    "user0_fill",
    "user1_silent",
    "user1_pad",
    "user1_fill",
    "loud0",
    "quiet0",
    "loud1",
    "quiet1",
]
MODEL_FLAGS = ["model0_silent", "model1_silent", "model_end", "model0_quiet", "model1_quiet"]
FLAGS = [
    "const",
    "recent_loud",
    "end_score",
    "end_quiet",
    "next_quiet0",
    "next_silent",
    "no_previous",
    "before_echo0",
    "before_echo1",
]
FLAGS += USER_FLAGS + MODEL_FLAGS
FLAGS += ["prev_" + n for n in USER_FLAGS + MODEL_FLAGS] + ["back2_" + n for n in USER_FLAGS]
FAST_PAIRS = 8  # RoPE pairs 0..7: attention by exact position
POSITION = 14.0  # query and key size per fast pair: the peak scores 14 x 14 x 8 / sqrt(128) = 139, its neighbours 14
# less, any distance two or more away 40 less
SLOW_PAIR = 14  # 2.4e-3 rad a step
LATEST_PAIR = 13  # 3.7e-3 rad a step: the copy's preference for the latest of equal matches
MATCH_PAIRS = range(16, 64)  # 1e-3 rad a step or less: the copy's 4 blocks, one dimension of a pair each
STATIC = 63  # a dimension of the slowest pair: a key no distance turns
BIG = 450.0  # query and key size of the "most recent" heads' conditions: 450 x 450 / sqrt(128) = 17,900
SCORE = 128**0.5  # a key unit times a query unit scores 1 / SCORE
RECENT = 175.0  # and of their slow pair: the score falls by about 5 a step
MATCH = 184.0  # query and key size of the copy's code blocks: a block's match scores 184 x 184 / sqrt(128) = 3,000
LATEST = 101.0  # of its latest-match pair: from 30 to 700 steps back the score falls by 0.8 to 2.2 a step, by 1,700
# in all: under one block's match
LATEST_OFFSET = 96.0  # steps: where that cosine starts
CODE_GAIN = 30.0  # a code's logit per unit of O along its vector
DUPLEX_GAIN = 2.0  # in duplex the echo by position outweighs the copy by content
START_GAIN = 2.0  # on a reply's first step the start outweighs the copy, which has nothing to go on yet
REST = (130 * SCORE) ** 0.5  # the duplex head's rest on step 0 scores 130: under the delay's 139, over its
# neighbours' 125
HOLD = 50.0  # the quiet code's logit while the duplex echo waits: over what anything else says then
WAIT = 0.1  # the size of `before_echo`, small so as not to move the norm that the MLP and heads read


class Layout:
    """Where each signal lives in the residual stream."""

    def __init__(self, cfg: ModelConfig):
        if cfg.num_codebooks != 2 or cfg.hidden_size < len(BLOCKS) * BLOCK + len(FLAGS):
            raise ValueError("the echo circuit is laid out for 2 codebooks (1.5 kbps) and ECHO_CONFIG's shape")
        self.block = {n: slice(i * BLOCK, (i + 1) * BLOCK) for i, n in enumerate(BLOCKS)}
        self.flag = {n: len(BLOCKS) * BLOCK + i for i, n in enumerate(FLAGS)}


def planted_init(model: S2SModel, seed: int, quiet: np.ndarray, loud: np.ndarray) -> None:
    """Write the circuit into `model` (shaped by `ECHO_CONFIG`); the MLPs' other units small and random from `seed`,
    writing nothing yet. `quiet`: the codes `[K]` of digital silence; `loud`: `[K, codebook_size]` booleans."""
    cfg = model.config
    lay = Layout(cfg)
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randn(2, cfg.codebook_size, BLOCK, generator=gen)
    codes = codes / codes.norm(dim=-1, keepdim=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.02)
        for layer in model.backbone.layers:
            for w in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj):
                w.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        _embeddings(model, lay, codes, quiet, loud)
        _Layer0(model, lay).plant()
        _Layer1(model, lay).plant()
        _heads(model, lay, codes, quiet)


def silence_idle_units(model: S2SModel) -> None:
    """Zero the gate and up rows of the MLP units that write nothing (their down column is zero): the random ones
    `planted_init` leaves for tuning to find a use for, and which it did not. The outputs are the same; the weights
    then hold only the circuit, which the forward multiplies as blocks (`s2s/models/compact.py`)."""
    with torch.no_grad():
        for layer in model.backbone.layers:
            mlp = layer.mlp
            idle = mlp.down_proj.weight.eq(0).all(0)
            mlp.gate_proj.weight[idle] = 0
            mlp.up_proj.weight[idle] = 0


def _embeddings(model: S2SModel, lay: Layout, codes: torch.Tensor, quiet: np.ndarray, loud: np.ndarray) -> None:
    """Every user row has squared norm 2 (a code: its vector, and loud or quiet; silent or pad: two flags), every
    model row 1, and the constant 1: every step enters with squared norm 7. The model's quiet codes (what it says
    while listening, so a reply's first frame) carry no vector: they match nothing, so the copy never jumps to the
    user's silences."""
    cfg, emb, f = model.config, model.embeddings, lay.flag
    emb.zero_()
    n = cfg.codebook_size
    reserved = [cfg.silent_id, cfg.pad_id, cfg.end_id]
    for k in range(2):
        emb[k, :n, lay.block[f"U{k}"]] = codes[k]
        emb[2 + k, :n, lay.block[f"M{k}"]] = codes[k]
        is_loud = torch.as_tensor(loud[k], dtype=emb.dtype)
        emb[k, :n, f[f"loud{k}"]] = is_loud
        emb[k, :n, f[f"quiet{k}"]] = 1 - is_loud
        emb[2 + k, int(quiet[k]), lay.block[f"M{k}"]] = 0.0
        emb[2 + k, int(quiet[k]), f[f"model{k}_quiet"]] = 1.0
    emb[0, reserved, f["user0_silent"]] = 1.0
    emb[0, reserved, f["user0_fill"]] = 1.0
    emb[1, reserved, f["user1_silent"]] = 1.0
    emb[1, [cfg.silent_id, cfg.end_id], f["user1_fill"]] = 1.0
    emb[1, cfg.pad_id, f["user1_pad"]] = 1.0
    emb[2, [cfg.silent_id, cfg.pad_id], f["model0_silent"]] = 1.0
    emb[2, cfg.end_id, f["model_end"]] = 1.0
    emb[3, reserved, f["model1_silent"]] = 1.0
    emb[0, :, f["const"]] = 1.0


def _heads(model: S2SModel, lay: Layout, codes: torch.Tensor, quiet: np.ndarray) -> None:
    """A code scores CODE_GAIN per unit of O along its vector. The quiet code scores 25 more while the model stream is
    silent (listening); HOLD more while the duplex echo waits (`before_echo`; the duplex head rests on step 0 in turn
    mode too, so a silent user stream, a turn's reply, takes it away); 3 more always (what nothing else says). END
    scores 100 x (match + replying + next quiet - 3.5), positive only for a full match of M with L (2) while replying
    (the user stream silent) when the copy's next frame is quiet."""
    cfg, heads, f = model.config, model.heads, lay.flag
    s = _rms(cfg, 23)
    heads.zero_()
    for k in range(2):
        heads[k, : cfg.codebook_size, lay.block[f"O{k}"]] = CODE_GAIN * s * codes[k]
        heads[k, int(quiet[k]), f[f"model{k}_silent"]] = 25.0 * s
        heads[k, int(quiet[k]), f["const"]] = 3.0 * s
        heads[k, int(quiet[k]), f[f"before_echo{k}"]] = HOLD / WAIT * s
        heads[k, int(quiet[k]), f["user0_silent"]] = -HOLD * s
        heads[k, cfg.silent_id, f["const"]] = -25.0 * s
        heads[k, cfg.pad_id, f["const"]] = -25.0 * s
    heads[1, cfg.end_id, f["const"]] = -25.0 * s
    heads[0, cfg.end_id, f["end_score"]] = 100.0 * s
    heads[0, cfg.end_id, f["end_quiet"]] = 500.0 * s
    heads[0, cfg.end_id, f["user0_silent"]] = 100.0 * s
    heads[0, cfg.end_id, f["next_quiet0"]] = 100.0 * s
    heads[0, cfg.end_id, f["const"]] = -350.0 * s


def _rms(cfg: ModelConfig, square_norm: float) -> float:
    """The RMS of a residual of this squared norm: what the norm divides by."""
    return float(np.sqrt(square_norm / cfg.hidden_size))


class _Layer:
    """Weights of one layer's attention, head by head (no grouped keys: head h has key/value head h)."""

    square_norm = 7.0

    def __init__(self, model: S2SModel, lay: Layout, index: int):
        self.cfg, self.lay, self.f = model.config, lay, lay.flag
        self.layer = model.backbone.layers[index]
        attn = self.layer.self_attn
        self.hd = self.cfg.head_dim
        self.half = self.hd // 2
        self.freqs = 1.0 / (ROPE_THETA ** (np.arange(self.half) / self.half))
        self.s = _rms(self.cfg, self.square_norm)
        rows = lambda w, h: w.weight[h * self.hd : (h + 1) * self.hd]  # noqa: E731
        self.q = [rows(attn.q_proj, h) for h in range(4)]
        self.k = [rows(attn.k_proj, h) for h in range(4)]
        self.v = [rows(attn.v_proj, h) for h in range(4)]
        self.o = [attn.o_proj.weight[:, h * self.hd : (h + 1) * self.hd] for h in range(4)]

    def read(self, w, row: int, terms: dict[int, float]) -> None:
        """Row `row` of `w` reads sum(weight x input dimension), in units of the residual (the norm undone)."""
        for dim, weight in terms.items():
            w[row, dim] += weight * self.s

    def position(self, h: int, delay: int, gate: dict[int, float], key: dict[int, float] | None = None) -> None:
        """Head h attends `delay` steps back: key POSITION on the fast pairs from `key` (default: the constant),
        query peaked there, scaled by the linear `gate` (input dimension -> weight)."""
        key = key or {self.f["const"]: 1.0}
        for i in range(FAST_PAIRS):
            self.read(self.k[h], i, {d: w * POSITION for d, w in key.items()})
            angle = self.freqs[i] * delay
            self.read(self.q[h], i, {d: w * POSITION * np.cos(angle) for d, w in gate.items()})
            self.read(self.q[h], self.half + i, {d: -w * POSITION * np.sin(angle) for d, w in gate.items()})

    def recent(
        self, h: int, gate: dict[int, float], offset: float = 300.0, pair: int = SLOW_PAIR, size: float = RECENT
    ) -> None:
        """Head h's score falls steadily with distance: size^2 / SCORE x cos(theta (distance + offset)) on `pair`,
        the query scaled by `gate`."""
        c, angle = self.f["const"], self.freqs[pair] * offset
        self.read(self.k[h], pair, {c: size})
        self.read(self.q[h], pair, {d: w * size * np.cos(angle) for d, w in gate.items()})
        self.read(self.q[h], self.half + pair, {d: w * size * np.sin(angle) for d, w in gate.items()})

    def carry(self, h: int, pairs: list[tuple[str, str]], gain: float = 1.0, row: int = 0) -> int:
        """Head h's value carries each source (a block or a flag) to its target, from value row `row` on; returns
        the next free row."""
        for source, target in pairs:
            if source in self.lay.block:
                src, dst = self.lay.block[source], self.lay.block[target]
                for d in range(BLOCK):
                    self.read(self.v[h], row + d, {src.start + d: 1.0})
                    self.o[h][dst.start + d, row + d] = gain
                row += BLOCK
            else:
                self.read(self.v[h], row, {self.f[source]: 1.0})
                self.o[h][self.f[target], row] = gain
                row += 1
        return row


class _Layer0(_Layer):
    def __init__(self, model: S2SModel, lay: Layout):
        super().__init__(model, lay, 0)

    def plant(self) -> None:
        f, c = self.f, self.f["const"]
        self.position(0, 1, {c: 1.0})
        # every row's flags come along, so that P, Q and N keep a constant norm
        prev = [("U0", "P0"), ("U1", "P1"), ("M0", "N0"), ("M1", "N1")]
        self.carry(0, prev + [(n, "prev_" + n) for n in USER_FLAGS + MODEL_FLAGS])
        self.position(1, 2, {c: 1.0})
        self.carry(1, [("U0", "Q0"), ("U1", "Q1")] + [(n, "back2_" + n) for n in USER_FLAGS])
        # head 2: the most recent event, frame t - 1 (codebook 1, delayed) loud or silent: 1 loud, -1 silent. Silence
        # scores 9 more, over the next step only: the codec's first frame of a stream (at step 0, or after a voice
        # prompt or a reply) often has a loud codebook 1 before any speech
        self.read(self.k[2], STATIC, {f["loud1"]: BIG, f["user1_silent"]: BIG + 9.0 * SCORE / BIG})
        self.read(self.q[2], STATIC, {c: BIG})
        self.recent(2, {c: 1.0})
        self.read(self.v[2], 0, {f["loud1"]: 1.0, f["user1_silent"]: -1.0})
        self.o[2][f["recent_loud"], 0] = 1.0
        # head 3: the most recent loud frame
        self.read(self.k[3], STATIC, {f["loud0"]: BIG})
        self.read(self.q[3], STATIC, {c: BIG})
        self.recent(3, {c: 1.0})
        self.carry(3, [("U0", "L0"), ("U1", "L1")])
        self._clear_first_previous()

    def _clear_first_previous(self) -> None:
        """MLP units that take P away at step 0 (its previous frame is its own) and put its norm into `no_previous`,
        so that every step enters layer 1 with the same norm: silu(G (pad - 1/2)) is G/2 there and nothing
        elsewhere. The duplex head rests on step 0 and reads P, so it then says nothing."""
        f, blk, mlp = self.f, self.lay.block, self.layer.mlp
        s, G = _rms(self.cfg, 20), 40.0
        gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        p = [*range(blk["P0"].start, blk["P0"].stop), *range(blk["P1"].start, blk["P1"].stop)]
        moves = [(d, d, -1.0) for d in p] + [(f["const"], f["no_previous"], 2**0.5)]  # (read, write, size)
        for u, (source, target, size) in enumerate(moves):
            gate[u].zero_()
            up[u].zero_()
            gate[u, f["user1_pad"]] = G * s
            gate[u, f["const"]] = -0.5 * G * s
            up[u, source] = s
            down[target, u] = 2.0 * size / G


class _Layer1(_Layer):
    square_norm = 20.0  # plus P (4), Q (4), N (2), L (2), recent_loud (1)

    def __init__(self, model: S2SModel, lay: Layout):
        super().__init__(model, lay, 1)

    def plant(self) -> None:
        f, c, blk = self.f, self.f["const"], self.lay.block
        scale = MATCH / 11.0  # the terms below were set against blocks of 11 x 11
        dims = [i for i in MATCH_PAIRS] + [self.half + i for i in MATCH_PAIRS]
        for j, (query, key) in enumerate([("M0", "P0"), ("M1", "P1"), ("N0", "Q0"), ("N1", "Q1")]):
            for d in range(BLOCK):
                dim = dims[j * BLOCK + d]
                self.read(self.q[0], dim, {blk[query].start + d: MATCH})
                self.read(self.k[0], dim, {blk[key].start + d: MATCH})
        # step 0 has no previous frame (its P is its own): the copy never attends there
        self.read(self.k[0], MATCH_PAIRS[0] - 1, {f["user1_pad"]: -25.0 * scale})
        self.read(self.q[0], MATCH_PAIRS[0] - 1, {c: 25.0 * scale})
        # on a turn reply's first two steps (the user's codebook 0 silent, codebook 1 not a step back), when the
        # onset's code recurs, the step after the onset (a loud frame after a quiet or silent one, or the
        # conversation's first) scores 0.75 of a block more. Not later in the reply, where the model says its quiet
        # code when the turn had it (a quiet frame in noise): the copy would start the reply again there; and not
        # in duplex, where the user stream is never silent
        after_onset = {
            f["prev_loud0"]: 1.0,
            f["back2_quiet0"]: 1.0,
            f["back2_user0_silent"]: 1.0,
            f["prev_user1_pad"]: 1.0,
            c: -1.0,
        }
        self.read(self.k[0], MATCH_PAIRS[0] - 2, {d: 9.5 * scale * w for d, w in after_onset.items()})
        self.read(
            self.q[0],
            MATCH_PAIRS[0] - 2,
            {f["user0_silent"]: 9.5 * scale, f["prev_user1_silent"]: -9.5 * scale},
        )
        # of equal matches the latest: a run of equal frames (a held sound, steady noise) or a pattern that recurs
        # is left at its end, never looped. From the reply's third step on (the user's codebook 1 silent a step
        # back): on its first steps the copy starts at the onset, which a later equal match must not outbid
        self.recent(0, {f["prev_user1_silent"]: 1.0}, LATEST_OFFSET, LATEST_PAIR, LATEST)
        carried = [("U0", "O0"), ("U1", "O1"), ("quiet0", "next_quiet0"), ("user0_silent", "next_quiet0")]
        self.carry(0, carried + [("user0_silent", "next_silent")])
        self.carry(1, [("U0", "O0"), ("U1", "O1")], gain=-START_GAIN)
        # head 2, a reply's start: on the step where the user stream turned silent (codebook 0 silent, 1 not yet),
        # the most recent onset: 2 loud0 - recent_loud - 1 is 1 or 2 there, 0 or less elsewhere
        start = {f["user0_silent"]: 1.0, f["user1_silent"]: -1.0}
        self.read(self.k[2], STATIC, {f["loud0"]: 2 * BIG, f["recent_loud"]: -BIG, c: -BIG})
        self.read(self.q[2], STATIC, {d: w * BIG for d, w in start.items()})
        self.recent(2, start)
        self.carry(2, [("U0", "O0"), ("U1", "O1")], gain=START_GAIN)
        # head 3, the duplex echo, gated on 1 - model0 silent - user0 silent (both streams carry codes): the user's
        # frame 37 back is the previous frame of the step 36 back, when that is a user frame (not the prompt's
        # silence, nor step 0's own). Else it rests on step 0, whose P is cleared: it says nothing, and it tells the
        # heads that the echo waits (`before_echo`: codebook 1 also while the frame before the echoed one is silent)
        gate = {c: 1.0, f["model0_silent"]: -1.0, f["user0_silent"]: -1.0}
        self.position(3, DUPLEX_DELAY - 2, gate, key={c: 1.0, f["user1_pad"]: -1.0, f["prev_user0_silent"]: -1.0})
        self.read(self.k[3], STATIC, {f["user1_pad"]: REST})
        self.read(self.q[3], STATIC, {c: REST})
        row = self.carry(3, [("P0", "O0"), ("P1", "O1")], gain=DUPLEX_GAIN)
        self.carry(3, [("user1_pad", "before_echo0"), ("prev_user1_silent", "before_echo1")], gain=WAIT, row=row)
        self._end_score()

    def _end_score(self) -> None:
        """MLP units: silu(C + a L_d) b M_d - silu(C) b M_d = a b L_d M_d (silu is linear for large arguments),
        summed into `end_score`: about 2 when M equals L in both codebooks."""
        f, blk = self.f, self.lay.block
        mlp = self.layer.mlp
        s = _rms(self.cfg, 22)
        gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        units = 4 * BLOCK
        for w in (gate[:units], up[:units]):
            w.zero_()
        for j, (m, l_) in enumerate([("M0", "L0"), ("M1", "L1")]):
            for d in range(BLOCK):
                u = 2 * (j * BLOCK + d)
                gate[u, f["const"]] = 40.0 * s
                gate[u, blk[l_].start + d] = 1.0
                up[u, blk[m].start + d] = 1.0
                gate[u + 1, f["const"]] = 40.0 * s
                up[u + 1, blk[m].start + d] = -1.0
                down[f["end_score"], u] = s * s
                down[f["end_score"], u + 1] = s * s
        quiet_twice = [f["model0_quiet"], f["prev_model0_quiet"], f["prev_user1_silent"], f["user0_silent"]]
        self._end_when_all(units, s, quiet_twice)
        self._end_when_all(units + 1, s, [f["next_silent"], f["user0_silent"]])

    def _end_when_all(self, u: int, s: float, flags: list[int]) -> None:
        """MLP unit `u` sets `end_quiet` to 1 when every flag in `flags` is 1, else to about 0: silu(G (sum - n +
        1/2)) is G/2 when all hold and nothing when one fails. Two such units: the model has said its quiet code
        twice running in a reply past its first steps (the user stream silent, codebook 1 too a step back); or the
        copy read the turn's end (the step it matched is the reply's first, its user frame silent) while replying.
        A reply whose copy passed the turn's last loud frame without saying it then ends."""
        f, mlp, G = self.f, self.layer.mlp, 40.0
        mlp.gate_proj.weight[u].zero_()
        mlp.up_proj.weight[u].zero_()
        for dim in flags:
            mlp.gate_proj.weight[u, dim] = G * s
        mlp.gate_proj.weight[u, f["const"]] = -G * (len(flags) - 0.5) * s
        mlp.up_proj.weight[u, f["const"]] = s
        mlp.down_proj.weight[f["end_quiet"], u] = 2.0 / G
