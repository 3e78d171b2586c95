"""s2s/engine/commands.py: each call is one command, checked by one rule, whether the engine's caller or a front
end's client makes it, and sent whole through pickle (as a front end sends it to the engine core)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine.commands import (
    Calls,
    ClearInput,
    Close,
    Command,
    Commit,
    EndTurn,
    Interrupt,
    Pause,
    PushAudio,
    PushCodes,
    Regenerate,
    Remove,
    Restart,
    SetSampling,
)
from s2s.engine.engine import Engine, EngineConfig, MetaEvent
from s2s.engine.handlers import HANDLERS

CONFIG = ModelConfig.preset("tiny", num_codebooks=1, codebook_size=256)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """Codec-free: its input is codes."""
    model = S2SModel.from_seed(CONFIG, seed=0)
    return Engine(model, None, EngineConfig(max_context=512, num_pages=200, max_reply_frames=4, calibration_ticks=0))


def example(cid: str) -> list[Command]:
    """One of each command, with good arguments."""
    return [
        PushAudio(cid, np.zeros(480, np.float32)),
        PushCodes(cid, np.full((1, 3), 7)),
        EndTurn(cid),
        Commit(cid),
        ClearInput(cid),
        Remove(cid, 1, "reply", keep_frames=2),
        Interrupt(cid, 5),
        Regenerate(cid),
        SetSampling(cid, SamplingParams(temperature=0.5, seed=3)),
        Pause(cid),
        Pause(cid, paused=False),
        Restart(cid),
        Close(cid),
        Close(cid, keep=True),
    ]


BAD = [  # (call, its arguments after the conversation, the command, the error's text); on a duplex conversation
    ("remove", (0, "both"), Remove("c", 0, "both"), "part must be user or reply"),
    ("remove", (0, "reply", -1), Remove("c", 0, "reply", -1), "keep_frames >= 0"),
    ("push_codes", (np.full((2, 3), 7),), PushCodes("c", np.full((2, 3), 7)), r"codes must be \[K=1"),
    ("push_codes", (np.full((1, 3), 256),), PushCodes("c", np.full((1, 3), 256)), r"must lie in \[0, 256\)"),
    ("push_audio", (np.zeros(480, np.float32),), PushAudio("c", np.zeros(480, np.float32)), "no codec"),
    ("end_turn", (), EndTurn("c"), "end_turn is for turn mode"),
    ("commit", (), Commit("c"), "commit is for turn mode"),
    ("clear_input", (), ClearInput("c"), "clear_input is for turn mode"),
    ("remove", (0, "user"), Remove("c", 0, "user"), "remove is for turn mode"),
    ("regenerate", (), Regenerate("c"), "regenerate is for turn mode"),
]


@pytest.mark.parametrize(("call", "args", "command", "message"), BAD, ids=[f"{b[0]}-{b[3]}" for b in BAD])
def test_a_bad_call_raises_the_same_error_from_the_engine_and_from_its_command(
    engine: Engine, call: str, args: tuple, command: Command, message: str
) -> None:
    cid = engine.open("duplex")
    try:
        with pytest.raises(ValueError, match=message):
            getattr(engine, call)(cid, *args)
        with pytest.raises(ValueError, match=message):  # as a front end's client checks it
            command.checked(CONFIG, has_codec=False).check_mode("duplex")
    finally:
        engine.close(cid)
        engine.step()


def test_samples_out_of_range_are_refused_and_good_ones_taken_as_float32() -> None:
    for bad in (np.full(4, 1.01), np.full(4, np.nan)):
        with pytest.raises(ValueError, match=r"finite samples in \[-1, 1\]"):
            PushAudio("c", bad).checked(CONFIG, has_codec=True)
    pcm = PushAudio("c", [[0.5, -0.5]]).checked(CONFIG, has_codec=True).pcm
    assert pcm.dtype == np.float32 and pcm.shape == (2,)


def test_every_call_on_a_conversation_not_open_is_a_key_error(engine: Engine) -> None:
    for command in example("nobody")[1:]:  # (not audio: this engine, with no codec, refuses that first)
        with pytest.raises(KeyError, match="no open session 'nobody'"):
            engine.submit(command)


def test_each_call_makes_its_command() -> None:
    class Recorder(Calls):
        def __init__(self) -> None:
            self.sent: list[Command] = []

        def submit(self, command: Command) -> None:
            self.sent.append(command)

    r = Recorder()
    r.push_audio("c", np.zeros(480, np.float32))
    r.push_codes("c", np.full((1, 3), 7))
    r.end_turn("c")
    r.commit("c")
    r.clear_input("c")
    r.remove("c", 1, "reply", keep_frames=2)
    r.interrupt("c", 5)
    r.regenerate("c")
    r.set_sampling("c", SamplingParams(temperature=0.5, seed=3))
    r.pause("c")
    r.unpause("c")
    r.restart("c")
    r.close("c")
    r.close("c", keep=True)
    assert [fields(c) for c in r.sent] == [fields(c) for c in example("c")]


def fields(command: Command) -> tuple:
    return type(command), {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in vars(command).items()}


def test_a_command_goes_through_pickle_whole_and_the_engine_applies_it(engine: Engine) -> None:
    for command in example("c"):
        assert fields(pickle.loads(pickle.dumps(command, protocol=5))) == fields(command)
    cid = engine.open("turn")
    for command in (PushCodes(cid, np.full((1, 20), 7)), EndTurn(cid), Pause(cid), Pause(cid, paused=False)):
        engine.submit(pickle.loads(pickle.dumps(command, protocol=5)))
    engine.step()
    events = engine.event_queue(cid)
    said = [e.data.get("event") for e in list(events.queue) if isinstance(e, MetaEvent)]
    assert [e for e in said if e in ("paused", "started")] == ["paused", "started"], "applied in the order they came"
    assert engine.sessions[cid].turns[-1].reply_start is not None, "the pushed codes were answered"
    engine.close(cid)
    engine.step()
    assert list(events.queue)[-1] is None


def test_every_command_has_its_handler() -> None:
    assert {type(c) for c in example("c")} <= set(HANDLERS)
