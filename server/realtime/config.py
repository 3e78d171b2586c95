"""A Realtime session's settings: `session.update` read in either dialect (GA's nested `audio.input` / `audio.output`,
or the beta's flat fields), checked whole, and the session object each dialect shows.

Every field a client sends is either applied, or accepted because it asks for what this server does anyway (no
tools, no transcription, the one audio format), or named in an error: nothing is silently ignored. An update with
any error changes nothing. A duplex session (a model that takes its own turns: `server/realtime/duplex.py`) has no
turn detection to set: only `turn_detection: null`, what it shows, is accepted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace

from codec.pcm import SAMPLE_RATE
from s2s import SamplingParams
from server.moshi.protocol import ProtocolError
from server.vad.config import VadConfig

STOP_BELOW_START = 0.15  # Silero's usual stop threshold under the start one
MAX_MS = 10_000  # the longest silence or prefix padding a turn detection setting may ask for


@dataclass(frozen=True)
class ServerVad:
    """`turn_detection: {"type": "server_vad", ...}`: the server's Silero endpointer."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300  # audio before the detected start that the item's `audio_start_ms` counts
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def vad(self, base: VadConfig) -> VadConfig:
        stop = max(0.0, self.threshold - STOP_BELOW_START)
        return replace(
            base, start_threshold=self.threshold, stop_threshold=stop, silence_s=self.silence_duration_ms / 1e3
        )

    def view(self) -> dict:
        return {"type": "server_vad", "idle_timeout_ms": None, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class SessionConfig:
    voice: str | None = None  # a voice prompt's name; None: none
    turn_detection: ServerVad | None = field(default_factory=ServerVad)  # None: the client commits
    sampling: SamplingParams = field(default_factory=SamplingParams)
    duplex: bool = False  # a full-duplex model's session: no turn detection (`turn_detection` stays None)

    def update(self, session: object, beta: bool, voices: list[str], vocab: int) -> SessionConfig:
        """This config with a `session.update`'s `session` applied; `ProtocolError` naming every field it cannot."""
        reader = _Reader(beta, voices, vocab)
        new = reader.read(self, session)
        if reader.problems:
            raise ProtocolError("; ".join(reader.problems), "invalid_session")
        return new

    def view(self, beta: bool, session_id: str, model: str) -> dict:
        """The session object of `session.created` and `session.updated`."""
        td = self.turn_detection.view() if self.turn_detection else None
        sampling = {
            "temperature": self.sampling.temperature,
            "top_k": self.sampling.top_k,
            "top_p": self.sampling.top_p,
            "seed": self.sampling.seed,
        }
        if beta:
            return {
                "id": session_id,
                "object": "realtime.session",
                "model": model,
                "modalities": ["audio", "text"],
                "voice": self.voice,
                "input_audio_format": "pcm16",
                "output_audio_format": "pcm16",
                "turn_detection": td,
                "input_audio_transcription": None,
                "tools": [],
                "tool_choice": "auto",
                "max_response_output_tokens": "inf",
                "instructions": "",
                **sampling,
            }
        fmt = {"type": "audio/pcm", "rate": SAMPLE_RATE}
        return {
            "type": "realtime",
            "id": session_id,
            "object": "realtime.session",
            "model": model,
            "output_modalities": ["audio"],
            "instructions": "",
            "tools": [],
            "tool_choice": "auto",
            "max_output_tokens": "inf",
            "audio": {
                "input": {"format": fmt, "turn_detection": td, "transcription": None, "noise_reduction": None},
                "output": {"format": fmt, "voice": self.voice, "speed": 1.0},
            },
            **sampling,
        }


# Fields that may be sent with the value this server has anyway (it has no tools, no text, no transcription).
_AS_IS: dict[str, tuple] = {
    "instructions": ("", None),
    "tools": ([], None),
    "tool_choice": ("auto", "none", None),
    "tracing": (None,),
    "truncation": ("auto", None),
    "max_output_tokens": ("inf", None),
    "max_response_output_tokens": ("inf", None),
    "transcription": (None,),
    "input_audio_transcription": (None,),
    "noise_reduction": (None,),
    "input_audio_noise_reduction": (None,),
    "speed": (1.0, 1, None),
    "model": None,  # any value: the endpoint checked the connection's
}


class _Reader:
    def __init__(self, beta: bool, voices: list[str], vocab: int):
        self.beta, self.voices, self.vocab, self.problems = beta, voices, vocab, []
        self.duplex = False

    def read(self, config: SessionConfig, session: object) -> SessionConfig:
        if not isinstance(session, dict):
            self.problems.append("session: must be an object")
            return config
        self.duplex = config.duplex
        changes: dict = {}
        sampling = dataclasses.asdict(config.sampling)
        for key, value in session.items():
            if key in ("temperature", "top_k", "top_p", "seed"):
                sampling[key] = value
            elif key == "type":
                self._expect(key, value, ("realtime",), "this server has realtime sessions only")
            elif key in ("output_modalities", "modalities"):
                ok = [["audio"]] if not self.beta else [["audio"], ["audio", "text"], ["text", "audio"]]
                self._expect(key, value, ok, "the model speaks audio only")
            elif key == "voice" and self.beta:
                changes["voice"] = self._voice(key, value)
            elif key == "turn_detection" and self.beta:
                changes["turn_detection"] = self._turn_detection(key, value, config.turn_detection)
            elif key in ("input_audio_format", "output_audio_format") and self.beta:
                self._expect(key, value, ("pcm16",), "audio is pcm16 at 24 kHz")
            elif key == "audio" and not self.beta:
                self._audio(value, config, changes)
            else:
                self._as_is(key, value)
        try:
            changes["sampling"] = SamplingParams(**sampling)
            # (what the client sets: the default, 250, may be past a small model's vocabulary, which it then all is)
            if "top_k" in session and changes["sampling"].top_k > self.vocab:
                self.problems.append(f"top_k: at most {self.vocab}, the model's vocabulary")
        except (TypeError, ValueError) as e:
            self.problems.append(f"sampling: {e}")
        return replace(config, **changes) if not self.problems else config

    def _audio(self, audio: object, config: SessionConfig, changes: dict) -> None:
        if not isinstance(audio, dict):
            return self.problems.append("audio: must be an object")
        for side, fields in audio.items():
            if side not in ("input", "output") or not isinstance(fields, dict):
                self.problems.append(f"audio.{side}: unknown (audio has input and output objects)")
                continue
            for key, value in fields.items():
                name = f"audio.{side}.{key}"
                if key == "format":
                    self._format(name, value)
                elif side == "input" and key == "turn_detection":
                    changes["turn_detection"] = self._turn_detection(name, value, config.turn_detection)
                elif side == "output" and key == "voice":
                    changes["voice"] = self._voice(name, value)
                else:
                    self._as_is(key, value, name)

    def _format(self, name: str, value: object) -> None:
        if (
            not isinstance(value, dict)
            or value.get("type") != "audio/pcm"
            or value.get("rate", SAMPLE_RATE) != SAMPLE_RATE
        ):
            supported = {"type": "audio/pcm", "rate": SAMPLE_RATE}
            self.problems.append(f"{name}: only {supported} is supported, got {value!r}")
        elif unknown := set(value) - {"type", "rate"}:
            self.problems.append(f"{name}: unknown fields {sorted(unknown)}")

    def _voice(self, name: str, value: object) -> str | None:
        if value is None or value in self.voices:
            return value
        known = ", ".join(sorted(self.voices)) or "none: the server was started without --prompts"
        self.problems.append(f"{name}: unknown voice {value!r}; this server's voices: {known}")
        return None

    def _turn_detection(self, name: str, value: object, current: ServerVad | None) -> ServerVad | None:
        if value is None:
            return None
        if self.duplex:
            self.problems.append(
                f"{name}: this model is full duplex: it hears the audio as it streams in and takes its own turns, "
                "so there is no turn detection to set (only null)"
            )
            return current
        if not isinstance(value, dict) or value.get("type") != "server_vad":
            kind = value.get("type") if isinstance(value, dict) else value
            self.problems.append(
                f"{name}.type: only server_vad (or null, for manual commits) is supported, got {kind!r}"
            )
            return current
        td, settings = current or ServerVad(), {}
        for key, v in value.items():
            if key == "type" or (key == "idle_timeout_ms" and v is None):
                continue
            if key not in {f.name for f in dataclasses.fields(ServerVad)}:
                self.problems.append(f"{name}.{key}: not supported")
                continue
            if key.endswith("_response"):
                kind, ok = "true or false", isinstance(v, bool)
            else:  # (a JSON true is an int to Python)
                kind = "a number" if key == "threshold" else "a whole number"
                ok = not isinstance(v, bool) and isinstance(v, int | float if key == "threshold" else int)
            if not ok:
                self.problems.append(f"{name}.{key}: must be {kind}, got {v!r}")
                continue
            settings[key] = v
        new = replace(td, **settings)
        if not (
            0 <= new.threshold <= 1 and 0 < new.silence_duration_ms <= MAX_MS and 0 <= new.prefix_padding_ms <= MAX_MS
        ):
            self.problems.append(
                f"{name}: need 0 <= threshold <= 1, 0 < silence_duration_ms <= {MAX_MS} "
                f"and 0 <= prefix_padding_ms <= {MAX_MS}"
            )
            return current
        return new

    def _expect(self, name: str, value: object, allowed, why: str) -> None:
        if value not in allowed:
            self.problems.append(f"{name}: {value!r} is not supported ({why})")

    def _as_is(self, key: str, value: object, name: str | None = None) -> None:
        name = name or key
        if key not in _AS_IS:
            self.problems.append(f"{name}: unknown or not supported")
        elif _AS_IS[key] is not None and not any(
            value == v and type(value) is type(v) or value is v for v in _AS_IS[key]
        ):
            self.problems.append(f"{name}: only {list(_AS_IS[key])} is supported here, got {value!r}")
