"""Generation defaults shared by the API (`Engine.generate`, `models.generate.generate`) and the
CLIs (`dejavu-run`, `dejavu-generate`), and their checks. No torch import: the CLIs check
sampling values before they import torch or load a model."""
from __future__ import annotations

from dataclasses import dataclass

from dejavu.errors import DejavuError


@dataclass(frozen=True)
class GenerationSettings:
    """The one place for generation defaults (API keyword defaults and CLI defaults)."""

    max_new_tokens: int = 64
    # None: greedy, unless top_k / top_p ask for sampling, then 1.0 (as vLLM, whose temperature
    # defaults to 1.0). An explicit 0 with top_k / top_p is an error, never silently greedy.
    temperature: float | None = None
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0 = off: tokens less likely than min_p times the most likely one are not drawn
    seed: int | None = None
    # None: the checkpoint's (generation_config.json, a GGUF file's general.sampling.penalty_repeat), as
    # transformers' generate applies it; 1.0 where it names none (off)
    repetition_penalty: float | None = None
    # OpenAI's, over the generated tokens: subtracted from a seen token's logit once / per occurrence (0 = off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


GENERATION = GenerationSettings()


def check_sampling(temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> None:
    """Reject settings that have no meaning (one-line DejavuError)."""
    if not 0.0 <= min_p <= 1.0:
        raise DejavuError(f"min_p must be in [0, 1], got {min_p}")
    if not temperature >= 0.0:
        raise DejavuError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise DejavuError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise DejavuError(f"top_p must be in (0, 1], got {top_p}")


def check_repetition_penalty(p: float) -> None:
    if not p > 0.0:
        raise DejavuError(f"repetition_penalty must be > 0 (1.0 = off), got {p}")


def check_openai_penalty(v, name: str) -> float:
    """A presence or frequency penalty as a float: a number in [-2, 2], OpenAI's range. DejavuError naming `name`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:  # NaN fails too
        raise DejavuError(f"{name} must be a number in [-2, 2], got {v!r}")
    return float(v)


def model_sampling(d, where) -> dict:
    """The temperature / top_p / top_k / min_p / repetition_penalty a checkpoint's authors ship (generation_config.json,
    a GGUF file's general.sampling.*, an engine header's sampling_defaults): the ones present in d, checked
    (temperature in [0, 2], the OpenAI API's range; top_p in (0, 1]; top_k >= 0; min_p in [0, 1];
    repetition_penalty > 0).
    DejavuError naming `where`."""
    out = {}
    for key, ok, want in (("temperature", lambda v: 0.0 <= v <= 2.0, "a number in [0, 2]"),
                          ("top_p", lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
                          ("top_k", lambda v: type(v) is int and v >= 0, "an integer >= 0"),
                          ("min_p", lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
                          ("repetition_penalty", lambda v: v > 0.0, "a number > 0")):
        v = d.get(key) if isinstance(d, dict) else None
        if v is None:
            continue
        if type(v) not in (int, float) or not ok(v):
            raise DejavuError(f"{where}: {key} {v!r} is not {want}")
        out[key] = v if key == "top_k" else float(v)
    return out


def resolve_temperature(temperature: float | None, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> float:
    """The temperature to sample with: None -> 0 (greedy), or 1.0 when top_k / top_p / min_p are set.

    temperature 0 with top_k > 0, top_p < 1 or min_p > 0 is a DejavuError: greedy decoding ignores
    them, and a user who asked for them wants sampling."""
    sampling = top_k > 0 or top_p < 1.0 or min_p > 0.0
    t = (1.0 if sampling else 0.0) if temperature is None else float(temperature)
    check_sampling(t, top_k, top_p, min_p)
    if t == 0.0 and sampling:
        raise DejavuError(f"top_k={top_k} / top_p={top_p} / min_p={min_p} need sampling, but temperature is 0 "
                          "(greedy); give a temperature > 0, or leave it unset for 1.0")
    return t


def check_max_new_tokens(n: int, minimum: int = 0, name: str = "max_new_tokens") -> int:
    if type(n) is not int or n < minimum:
        raise DejavuError(f"{name} must be an integer >= {minimum}, got {n!r}")
    return n
