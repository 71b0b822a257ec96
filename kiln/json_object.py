"""JSON from outside the process (a model config, Inductor patches, a directory's config.json, a store's manifest),
parsed within bounds Python's parser does not set itself: UTF-8 only, nesting at most MAX_DEPTH deep, integers of
at most MAX_INT_DIGITS digits, finite numbers, no key twice. A text past a bound is the sender's error, never an
INTERNAL from a RecursionError or a 4,300-digit integer deep inside the parser."""

import json
import math

from kiln.errors import InvalidArgument

MAX_DEPTH = 64  # a model config nests three or four levels (rope_parameters per layer type)
MAX_INT_DIGITS = 24  # a 64-bit integer has at most 20 digits and a sign


class UnboundedJson(ValueError):
    """JSON that is malformed or past a bound; a ValueError, so that callers that refuse malformed JSON refuse it."""


def bounded_loads(text: str | bytes) -> object:
    """``json.loads`` within the bounds above; UnboundedJson says which one was passed and where."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UnboundedJson(f"not UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant,
                           object_pairs_hook=_object)
    except RecursionError:
        raise UnboundedJson(f"nested more than {MAX_DEPTH} deep") from None
    except UnboundedJson:
        raise
    except ValueError as exc:  # JSONDecodeError, and anything else the parser refuses
        raise UnboundedJson(f"malformed JSON: {exc}") from None
    _check_depth(value)
    return value


def parse_json_object(text: str | bytes, field: str) -> dict:
    """A JSON object from a client, INVALID_ARGUMENT naming ``field`` for anything else."""
    try:
        value = bounded_loads(text)
    except UnboundedJson as exc:
        raise InvalidArgument(f"{field}: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field}: expected a JSON object")
    return value


def _int(digits: str) -> int:
    if len(digits) > MAX_INT_DIGITS:
        raise UnboundedJson(f"an integer of {len(digits)} digits, more than {MAX_INT_DIGITS}")
    return int(digits)


def _float(text: str) -> float:
    if len(text) > 64:
        raise UnboundedJson(f"a number of {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise UnboundedJson(f"{text[:32]} is not a finite number")
    return value


def _constant(name: str) -> float:
    raise UnboundedJson(f"{name} is not JSON")


def _object(pairs: list[tuple[str, object]]) -> dict:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise UnboundedJson(f"the key {twice[:64]!r} appears twice")
    return value


def _check_depth(value: object) -> None:
    """Iteratively, so that the check itself cannot overflow the stack."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > MAX_DEPTH:
                raise UnboundedJson(f"nested more than {MAX_DEPTH} deep")
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
