"""From a request's structured-output description to a validated llguidance grammar."""

from __future__ import annotations

import json
from functools import lru_cache

from infer.core.sampling_params import InvalidRequestError
from infer.core.structured import StructuredOutputs
from infer.structured.ascii_regex import ascii_regex, ascii_schema


class GrammarError(InvalidRequestError):
    """The schema, regex or grammar cannot be compiled; the message says why."""


def compile_grammar(spec: StructuredOutputs) -> str:
    """The llguidance grammar of ``spec``; raises :class:`GrammarError` naming the problem."""
    return _compile(spec.cache_key, spec.param)


@lru_cache(maxsize=256)
def _compile(key: tuple, param: str) -> str:
    from llguidance import LLMatcher, grammar_from

    kind, value = key
    try:
        if kind == "json":
            schema = json.loads(value)
            if not isinstance(schema, dict | bool):
                raise GrammarError("the JSON schema must be an object", param=param)
            # ECMA-262 patterns: \d, \w, \s are ASCII there (ascii_regex.py)
            value = json.dumps(ascii_schema(schema))
            grammar = LLMatcher.grammar_from_json_schema(value, defaults=_COMPACT)
        elif kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_COMPACT)
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(ascii_regex(value))
        elif kind == "choice":
            grammar = grammar_from("choice", json.dumps(list(value)))
        else:
            grammar = grammar_from("grammar", value)
    except GrammarError:
        raise
    except (ValueError, TypeError, RuntimeError) as e:
        raise GrammarError(f"invalid {_NAMES[kind]}: {_first_line(e)}", param=param) from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"invalid {_NAMES[kind]}: {_first_line(error)}", param=param)
    return grammar


# NOTE: JSON without free whitespace: a model (a random test model especially) can otherwise
# spend its whole max_tokens on spaces and newlines between tokens.
_COMPACT = {"whitespace_flexible": False}

_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
          "choice": "choice list", "grammar": "grammar"}  # fmt: skip


def _first_line(error: object) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else type(error).__name__
