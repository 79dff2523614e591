"""English text available on every machine with Python: the bundled documentation.

``pydoc_data.topics`` holds the language reference sections that ``help()`` shows (~460 KB);
the standard library's module docstrings add more prose. Both are cleaned of reST markup
noise so models trained on them learn sentences rather than underlines.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
import warnings

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


def stdlib_docstrings(max_modules: int = 400) -> list[str]:
    """Module docstrings of pure-Python standard library modules, in a fixed (sorted) order.

    Only modules that import quietly and whose docstring is prose-sized (>= 200 characters).
    """
    skip = ("test", "idlelib", "tkinter", "turtle", "antigravity", "this", "__")
    names = sorted(
        m.name
        for m in pkgutil.iter_modules()
        if m.name in sys.stdlib_module_names and not m.name.startswith(skip)
    )
    docs: list[str] = []
    for name in names[:max_modules]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - some stdlib modules need optional C parts
            continue
        doc = getattr(mod, "__doc__", None)
        if isinstance(doc, str) and len(doc) >= 200:
            docs.append(clean(doc))
    return docs


def load_corpus(include_docstrings: bool = True) -> list[str]:
    """All offline documents: pydoc topics, then (optionally) stdlib module docstrings."""
    docs = pydoc_topics()
    if include_docstrings:
        docs += stdlib_docstrings()
    return [d for d in docs if d]
