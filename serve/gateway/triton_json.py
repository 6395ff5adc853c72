"""JSON as Triton reads it (rapidjson): what the KServe codec and the generate extension parse a body with, and
the words Triton refuses a body with."""

from __future__ import annotations

import json
import math
import re

import orjson

from dstool.serve.gateway.tensors import GatewayError

# orjson's limit (Triton's parser has none): deeper JSON is refused as a parse error
TOO_DEEP = "failed to parse the request JSON buffer: nested deeper than 1024 levels"
_NON_FINITE = re.compile(rb"-?(?:NaN|Infinity)")
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|-?[0-9][0-9.eE+-]*')


def _too_big() -> float:
    raise OverflowError


def _double(literal: str) -> float:
    value = float(literal)
    return value if math.isfinite(value) else _too_big()


def _integer(literal: str) -> int | float:
    """An integer literal as rapidjson keeps it: int64 or uint64 when it fits, a double otherwise."""
    if len(literal) <= 20 and -2**63 <= (value := int(literal)) < 2**64:
        return value
    return _double(literal)


def parse_json(text: bytes):
    """JSON as Triton (rapidjson) reads it: NaN and Infinity literals and a UTF-8 byte order mark taken, a number
    beyond double range refused."""
    text = text.split(b"\0", 1)[0]  # rapidjson reads a C string: the document ends at the first NUL byte
    if text[:3] == b"\xef\xbb\xbf":
        text = text[3:]
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as e:
        if e.msg.startswith("number is infinity"):
            raise _too_big_at(e.pos) from None
        if e.msg.startswith("depth limit"):
            raise GatewayError(400, TOO_DEEP) from None
        if not _NON_FINITE.match(text, e.pos):
            raise GatewayError(400, f"failed to parse the request JSON buffer: {e}") from None
    try:  # orjson refuses NaN/Infinity, which rapidjson takes; Python's json takes them too
        value = json.loads(text, parse_float=_double, parse_int=_integer)
        orjson.dumps(value)  # what orjson refuses besides (lone surrogates)
        return value
    except OverflowError:
        raise _too_big_at(next(m.start() for m in _JSON_TOKEN.finditer(text)
                               if m.group()[0] != 34 and not math.isfinite(float(m.group())))) from None
    except RecursionError:
        raise GatewayError(400, TOO_DEEP) from None
    except (ValueError, UnicodeDecodeError, orjson.JSONEncodeError) as e:
        raise GatewayError(400, f"failed to parse the request JSON buffer: {e}") from None


def _too_big_at(offset: int) -> GatewayError:
    return GatewayError(400, f"failed to parse the request JSON buffer: Number too big to be stored in double. at "
                             f"{offset}")


def default_new_tokens(config: dict) -> int:
    """The tokens a generating model's answer may have when its request names none: the `default_max_new_tokens`
    parameter its export wrote into its config (0 for a model without one)."""
    return int((config.get("parameters") or {}).get("default_max_new_tokens", {}).get("string_value", "0"))
