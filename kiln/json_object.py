"""A JSON object from the wire (a model config, Inductor patches): malformed text or another JSON type is the
caller's error, naming the field."""

import json

from kiln.errors import InvalidArgument


def parse_json_object(text: str, field: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{field}: malformed JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field}: expected a JSON object")
    return value
