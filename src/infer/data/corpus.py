"""English text available on every machine with Python: the bundled documentation.

``pydoc_data.topics`` holds the language reference sections that ``help()`` shows (~460 KB);
the standard library's module docstrings add more prose. Both are cleaned of reST markup
noise so models trained on them learn sentences rather than underlines. The docstrings of the
standard library's functions and classes (:func:`stdlib_api_docstrings`) are as much again.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
import warnings
from types import ModuleType

_RULE = re.compile(r"^\s*[=\-~*^+#]{3,}\s*$", re.MULTILINE)
_BLANKS = re.compile(r"\n{3,}")
_SPACES = re.compile(r"[ \t]+\n")


def clean(text: str) -> str:
    """Drop reST heading underlines and trailing spaces; collapse runs of blank lines."""
    text = _RULE.sub("", text)
    text = _SPACES.sub("\n", text)
    return _BLANKS.sub("\n\n", text).strip()


def pydoc_topics() -> list[str]:
    """The ``help()`` topics of the running Python, one cleaned document each, in a fixed order."""
    from pydoc_data.topics import topics

    return [clean(topics[name]) for name in sorted(topics)]


def stdlib_modules(max_modules: int = 400) -> list[tuple[str, ModuleType]]:
    """The pure-Python standard library modules that import quietly, in a fixed (sorted) order."""
    skip = ("test", "idlelib", "tkinter", "turtle", "antigravity", "this", "__")
    names = sorted(
        m.name
        for m in pkgutil.iter_modules()
        if m.name in sys.stdlib_module_names and not m.name.startswith(skip)
    )
    modules = []
    for name in names[:max_modules]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                modules.append((name, importlib.import_module(name)))
        except Exception:  # noqa: BLE001 - some stdlib modules need optional C parts
            continue
    return modules


def stdlib_docstrings(max_modules: int = 400) -> list[str]:
    """Module docstrings of pure-Python standard library modules, in a fixed (sorted) order.

    Only modules that import quietly and whose docstring is prose-sized (>= 200 characters).
    """
    docs: list[str] = []
    for _, mod in stdlib_modules(max_modules):
        doc = getattr(mod, "__doc__", None)
        if isinstance(doc, str) and len(doc) >= 200:
            docs.append(clean(doc))
    return docs


def stdlib_api_docstrings(
    max_modules: int = 400, min_chars: int = 100
) -> list[tuple[str, str, list[str]]]:
    """The docstrings of each standard library module's public API, in a fixed order.

    One ``(module name, cleaned module docstring, [docstrings])`` per module of
    :func:`stdlib_modules` that has any: the public functions and classes it defines and the
    public methods of those classes, each cleaned, at least ``min_chars`` long and not a
    repeat of an earlier one. About 550 KB, as much again as :func:`load_corpus`, but terser:
    one paragraph on what a function takes and returns.
    """
    seen: set[str] = set()
    out = []
    for name, mod in stdlib_modules(max_modules):
        docs: list[str] = []

        def add(obj, docs=docs) -> None:
            doc = getattr(obj, "__doc__", None)
            if not isinstance(doc, str) or len(doc) < min_chars:
                return
            doc = clean(inspect.cleandoc(doc))
            if doc not in seen:
                seen.add(doc)
                docs.append(doc)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated aliases warn when touched
            for attr, obj in sorted(vars(mod).items()):
                if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                    continue
                add(obj)
                if inspect.isclass(obj):
                    for member, value in sorted(vars(obj).items()):
                        if not member.startswith("_"):
                            add(value)
        if docs:
            module_doc = mod.__doc__ if isinstance(mod.__doc__, str) else ""
            out.append((name, clean(module_doc), docs))
    return out


def load_corpus(include_docstrings: bool = True) -> list[str]:
    """All offline documents: pydoc topics, then (optionally) stdlib module docstrings."""
    docs = pydoc_topics()
    if include_docstrings:
        docs += stdlib_docstrings()
    return [d for d in docs if d]
