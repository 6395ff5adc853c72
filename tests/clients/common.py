"""What every client script shares: the gateway's address from the environment, small bounded schemas (the served
model writes nonsense, so a grammar-forced answer must end quickly: short strings, enums, small integers), and a
runner that runs each check, keeps going after a failure, and prints one JSON line of results for the test.

Run by a client venv's python (scripts/client-venvs.sh), never by .venv's: only the standard library and pydantic
(which every client library depends on) are imported here."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, Field

BASE = os.environ["DSTOOL_GATEWAY"]  # http://127.0.0.1:PORT
KEY = os.environ["DSTOOL_API_KEY"]
MODEL = "dstool_lm"
OPENAI_URL = BASE + "/v1"


class Speaker(BaseModel):
    """The structured answer every library asks for."""

    name: str = Field(max_length=12)
    act: int = Field(ge=1, le=5)
    mood: Literal["calm", "angry", "merry"]


class Weather(BaseModel):
    """A tool's arguments."""

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


ASK = "Who speaks first, in which act, and how?"
WEATHER_ASK = "What is the weather in Verona?"
CHECKS: list[tuple[str, Callable]] = []


def check(fn: Callable) -> Callable:
    CHECKS.append((fn.__name__, fn))
    return fn


def weather(city: str, unit: str) -> str:
    return f"Sunny in {city[:12]}, 21 degrees {unit}"


def until_text(answer: Callable[[], str], tries: int = 3) -> str:
    """`answer()` (a call whose checks passed, returning its text) until its text is not empty, `tries` times at
    most: a sampled answer of this model may end at its first token, with no text (about 1 in 50 here)."""
    for _ in range(tries):
        text = answer()
        if text:
            return text
    raise AssertionError(f"{tries} answers in a row had no text")


def is_speaker(value) -> Speaker:
    """`value` as a Speaker, its fields in their bounds (a Speaker of the script's own or any model shaped as one)."""
    data = value.model_dump() if isinstance(value, BaseModel) else value
    speaker = Speaker.model_validate(data)
    assert set(data) == {"name", "act", "mood"}, data
    return speaker


def run(only: list[str] | None = None) -> None:
    """Run the checks (or those named on the command line); print {"check": "ok" | the error} as one JSON line."""
    only = only if only is not None else sys.argv[1:]
    results: dict[str, dict] = {}
    for name, fn in CHECKS:
        if only and name not in only:
            continue
        start = time.monotonic()
        try:
            fn()
            results[name] = {"ok": True, "seconds": round(time.monotonic() - start, 2)}
        except BaseException as e:  # noqa: B036 - a check's any failure is its result
            results[name] = {"ok": False, "seconds": round(time.monotonic() - start, 2),
                             "error": "".join(traceback.format_exception(e))[-4000:]}
    print("RESULTS " + json.dumps(results), flush=True)
