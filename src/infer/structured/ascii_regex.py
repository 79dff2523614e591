"""``\\d``, ``\\w``, ``\\s`` as ASCII classes, as users of JSON Schema's ``pattern`` mean them.

llguidance reads regexes as Rust's ``regex`` crate does, where ``\\d`` is any Unicode decimal
digit (``١``, ``𜳴``) and ``\\w``, ``\\s`` are Unicode too. JSON Schema's ``pattern`` is ECMA-262,
where ``\\d`` is ``[0-9]`` and ``\\w`` is ``[0-9A-Za-z_]``; whoever writes ``\\d{3}`` for a code or
a phone number means ASCII, and so do the other serving engines' constraint backends. So every
regex a request gives (``regex``, ``guided_regex``, a JSON schema's ``pattern`` and
``patternProperties``) is rewritten before it is compiled::

    outside a class:  \\d -> [0-9]    \\D -> [^0-9]    \\w -> [0-9A-Za-z_]   \\W -> [^0-9A-Za-z_]
                      \\s -> [\\t\\n\\v\\f\\r ]               \\S -> [^\\t\\n\\v\\f\\r ]
    inside  [...]:    \\d -> 0-9      \\D -> [:^digit:]  \\w -> 0-9A-Za-z_   \\W -> [:^word:]
                      \\s -> \\t\\n\\v\\f\\r                 \\S -> [:^space:]

(``[:^digit:]`` and friends are the Rust syntax's ASCII classes, negated, nested in the
bracket.) ``\\b`` and ``\\B`` (word boundaries) cannot be expressed without look-around, which
the grammar engine does not have: they are refused with an error naming them rather than
compiled into a pattern that matches nothing. Everything else is left as written.
"""

from __future__ import annotations

_OUTSIDE = {
    "d": "[0-9]",
    "D": "[^0-9]",
    "w": "[0-9A-Za-z_]",
    "W": "[^0-9A-Za-z_]",
    "s": r"[\t\n\v\f\r ]",
    "S": r"[^\t\n\v\f\r ]",
}
_INSIDE = {
    "d": "0-9",
    "D": "[:^digit:]",
    "w": "0-9A-Za-z_",
    "W": "[:^word:]",
    "s": r"\t\n\v\f\r ",
    "S": "[:^space:]",
}


_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})


class UnsupportedRegex(ValueError):
    """A regex construct the grammar engine cannot express; the message names it."""


def ascii_regex(pattern: str) -> str:
    """``pattern`` with its ``\\d \\w \\s`` (and capitals) made ASCII (see the module doc)."""
    out: list[str] = []
    depth = 0  # nesting of [...] classes (Rust's syntax nests them)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            if e in "bB":
                raise UnsupportedRegex(
                    f"\\{e} (a word boundary) is not supported in constrained outputs: the "
                    "grammar engine has no look-around"
                )
            table = _INSIDE if depth else _OUTSIDE
            out.append(table.get(e, c + e))
            i += 2
            continue
        if c == "[":
            if depth and pattern.startswith("[:", i):  # a POSIX class inside a bracket
                end = pattern.find(":]", i + 2)
                if end != -1:
                    out.append(pattern[i : end + 2])
                    i = end + 2
                    continue
            depth += 1
            out.append(c)
            i += 1
            # a ']' right after '[' or '[^' is a literal, not the end of the class
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


def ascii_schema(schema: object) -> object:
    """A JSON schema (parsed) with every ``pattern`` and ``patternProperties`` key rewritten by
    :func:`ascii_regex`; other values untouched."""
    if isinstance(schema, list):
        return [ascii_schema(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYS:  # instances, not schemas: left as written
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            out[key] = ascii_regex(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ascii_regex(k): ascii_schema(v) for k, v in value.items()}
        else:
            out[key] = ascii_schema(value)
    return out
