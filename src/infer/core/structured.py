"""What a constrained request's output must match (no torch, no grammar engine here).

``StructuredOutputs`` is the request-side description, as vLLM's ``structured_outputs`` takes it:
exactly one of a JSON schema, "any JSON object", a regular expression, a list of choices or a
grammar (Lark, or GBNF / EBNF as llama.cpp writes them). ``infer.structured`` compiles it with
the grammar engine and constrains each sampled token to what can still match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from infer.core.sampling_params import InvalidRequestError


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark, or GBNF / EBNF
    # The request field it came from, for error messages (``response_format``, ``guided_json``,
    # ``structured_outputs.regex``, ...).
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured outputs need exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}",
                param=self.param,
            )
        if self.choice is not None:
            if not self.choice:
                raise InvalidRequestError("the choice list is empty", param=self.param)
            if not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError("every choice must be a string", param=self.param)
        if self.regex is not None and not self.regex:
            raise InvalidRequestError("the regex is empty", param=self.param)
        if self.grammar is not None and not self.grammar.strip():
            raise InvalidRequestError("the grammar is empty", param=self.param)

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def cache_key(self) -> tuple[str, Any]:
        """Equal for requests that compile to the same grammar."""
        value = {"json": self.json, "regex": self.regex, "choice": self.choice,
                 "grammar": self.grammar}.get(self.kind)  # fmt: skip
        return (self.kind, value)
