"""The request fields that ask for structured output, as OpenAI and vLLM spell them.

- ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
- vLLM's ``structured_outputs``: ``{"json": schema}``, ``{"regex": ...}``, ``{"choice": [...]}``,
  ``{"grammar": Lark or GBNF}``, ``{"json_object": true}``;
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

At most one of them per request. Each becomes a :class:`StructuredOutputs` whose grammar is
compiled here, before the request is queued, so a bad schema is a 400 naming its field.
"""

from __future__ import annotations

import json
from typing import Any

from infer.core.sampling_params import InvalidRequestError
from infer.core.structured import StructuredOutputs
from infer.structured import compile_grammar

STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")  # fmt: skip
_STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object"}
# vLLM options that ask for what infer does anyway (compact JSON, no extra properties
# unless the schema allows them): accepted, nothing to do.
_IGNORED_KEYS = {"disable_any_whitespace", "disable_fallback", "disable_additional_properties"}


def structured_outputs_of(extra: dict[str, Any]) -> StructuredOutputs | None:
    """The request's structured-output constraint, compiled and checked; None if it has none.

    Raises ``InvalidRequestError`` naming the field for anything malformed or uncompilable.
    """
    given = [k for k in STRUCTURED_FIELDS if extra.get(k) is not None]
    if "response_format" in given and _is_text(extra["response_format"]):
        given.remove("response_format")
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError(
            f"give at most one of {', '.join(given)}: each asks for a structured output",
            param=given[1],
        )
    field = given[0]
    value = extra[field]
    if field == "response_format":
        spec = _response_format(value)
    elif field == "structured_outputs":
        spec = _structured_outputs(value)
    elif field == "guided_json":
        spec = StructuredOutputs(json=_schema_text(value, field), param=field)
    elif field == "guided_regex":
        spec = StructuredOutputs(regex=_string(value, field), param=field)
    elif field == "guided_choice":
        spec = StructuredOutputs(choice=_choices(value, field), param=field)
    else:
        spec = StructuredOutputs(grammar=_string(value, field), param=field)
    compile_grammar(spec)
    return spec


def _is_text(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def _response_format(value: Any) -> StructuredOutputs:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError("response_format must be an object with a type", param=param)
    kind = value["type"]
    if kind == "json_object":
        return StructuredOutputs(json_object=True, param=param)
    if kind != "json_schema":
        raise InvalidRequestError(
            f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
            param="response_format.type",
        )
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema must be an object", param=param)
    schema = spec.get("schema")
    if schema is None:
        schema = spec.get("json_schema")  # some clients nest it under this name
    if schema is None:
        raise InvalidRequestError(
            "response_format.json_schema.schema is missing", param=param + ".schema"
        )
    return StructuredOutputs(json=_schema_text(schema, param + ".schema"), param=param)


def _structured_outputs(value: Any) -> StructuredOutputs:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object", param=param)
    unknown = sorted(set(value) - _STRUCTURED_KEYS - _IGNORED_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs: unsupported key(s) {', '.join(unknown)} "
            f"(supported: {', '.join(sorted(_STRUCTURED_KEYS))})",
            param=f"{param}.{unknown[0]}",
        )
    given = [k for k in sorted(_STRUCTURED_KEYS) if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError(
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
            f"got {', '.join(given) or 'none'}",
            param=param,
        )
    key = given[0]
    sub = f"{param}.{key}"
    if key == "json":
        return StructuredOutputs(json=_schema_text(value[key], sub), param=sub)
    if key == "json_object":
        return StructuredOutputs(json_object=True, param=sub)
    if key == "choice":
        return StructuredOutputs(choice=_choices(value[key], sub), param=sub)
    if key == "regex":
        return StructuredOutputs(regex=_string(value[key], sub), param=sub)
    return StructuredOutputs(grammar=_string(value[key], sub), param=sub)


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise InvalidRequestError("the JSON schema must be a JSON object", param=param)
    return json.dumps(schema)  # the schema's own property order is the output's


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
    return value


def _choices(value: Any, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise InvalidRequestError(f"{param} must be a list of strings", param=param)
    if not value:
        raise InvalidRequestError(f"{param} is empty: give at least one choice", param=param)
    return tuple(value)
