r"""Regexes of constrained outputs: `\d`, `\w`, `\s` rewritten to their ASCII classes (JSON
Schema's ECMA-262 meaning), everything else as written; word boundaries refused by name."""

from __future__ import annotations

import re

import pytest

from infer.structured.ascii_regex import UnsupportedRegex, ascii_regex, ascii_schema


@pytest.mark.parametrize(
    ("pattern", "want"),
    [
        (r"[a-c]{2,5}-\d{3}", r"[a-c]{2,5}-[0-9]{3}"),
        (r"\D\W\S", r"[^0-9][^0-9A-Za-z_][^\t\n\v\f\r ]"),
        (r"[\d.]+", r"[0-9.]+"),
        (r"[^\s,]", r"[^\t\n\v\f\r ,]"),
        (r"[\D\W]", r"[[:^digit:][:^word:]]"),
        (r"[]\d]", r"[]0-9]"),  # a ']' first in a class is a literal
        (r"[[:alpha:]\w]", r"[[:alpha:]0-9A-Za-z_]"),
        (r"\\d\\w", r"\\d\\w"),  # escaped backslashes stay
        (r"\p{L}+\.\d", r"\p{L}+\.[0-9]"),
        (r"a|b(c)*", r"a|b(c)*"),
    ],
)
def test_rewrites_only_the_class_escapes(pattern, want):
    assert ascii_regex(pattern) == want


@pytest.mark.parametrize("text", ["123", "abc_9", " \t\n", "١٢٣", "é", "\u00a0", "\U0001ccf4"])
def test_rewritten_classes_match_what_ascii_classes_match(text):
    for cls in (r"\d", r"\w", r"\s", r"\D", r"\W", r"\S"):
        pattern = f"{cls}+"
        assert bool(re.fullmatch(ascii_regex(pattern), text)) == bool(
            re.fullmatch(pattern, text, re.ASCII)
        ), (cls, text)


def test_word_boundaries_are_refused():
    for pattern in (r"\bword", r"a\B"):
        with pytest.raises(UnsupportedRegex, match="word boundary"):
            ascii_regex(pattern)


def test_schema_patterns_and_pattern_property_keys_are_rewritten_but_not_data():
    schema = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": r"^\d+$"},
            "pattern": {"type": "string"},  # a property named "pattern"
        },
        "patternProperties": {r"^\w+$": {"type": "string", "pattern": r"\s"}},
        "default": {"pattern": r"\d"},
        "anyOf": [{"pattern": r"\w"}],
    }
    got = ascii_schema(schema)
    assert got["properties"]["code"]["pattern"] == "^[0-9]+$"
    assert got["properties"]["pattern"] == {"type": "string"}
    assert got["patternProperties"] == {
        "^[0-9A-Za-z_]+$": {"type": "string", "pattern": r"[\t\n\v\f\r ]"}
    }
    assert got["default"] == {"pattern": r"\d"}
    assert got["anyOf"] == [{"pattern": "[0-9A-Za-z_]"}]
