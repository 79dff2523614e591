"""``infer bench results``: stitch the latest saved reports into one RESULTS.md skeleton.

Takes from the reports folder: the micro reports (``micro_<suite>.md``), the newest ablation log
(``ablation_*/ABLATION.md``), else the newest serving report (``serve_*/report.md``), and the
newest client-test report (``client_*.md``). Headings move one level down, image links are
rewritten relative to the output file, and each section ends with a placeholder for the two or
three sentences of reading that only a person who looked at the numbers can write.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")

READING = "> **Reading**: _(two or three sentences: what helped, what it cost, and why)_"

MICRO_SUITES = ("kv-cache", "batching", "chunked-prefill", "scheduling", "prefix-cache")
"""The suites of ``infer bench micro`` (benchmarks/micro/), in report order."""


def _newest(paths: list[Path]) -> Path | None:
    return max(paths, key=lambda p: p.stat().st_mtime) if paths else None


def embed(md_path: Path, out_path: Path, drop_title: bool = True) -> str:
    """The markdown of ``md_path`` for inclusion in ``out_path``: headings one level deeper,
    its first ``# `` title dropped, image links made relative to ``out_path``."""
    lines = md_path.read_text().splitlines()
    if drop_title and lines and lines[0].startswith("# "):
        lines = lines[1:]
    out = []
    for line in lines:
        if line.startswith("#"):
            line = "#" + line

        def fix(m: re.Match) -> str:
            target = m.group(2)
            if "://" in target or target.startswith("/"):
                return m.group(0)
            rel = os.path.relpath(md_path.parent / target, out_path.parent)
            return f"![{m.group(1)}]({rel})"

        out.append(_IMAGE.sub(fix, line))
    return "\n".join(out).strip()


def build_results(reports: str | Path, out: str | Path) -> str:
    """The RESULTS.md text from what ``reports`` holds (sections without reports are noted)."""
    reports, out = Path(reports), Path(out)
    parts = [
        "# Results on this machine",
        "",
        "Every table below was produced by `infer bench` on this machine; numbers from other"
        " hardware differ, so compare shapes, not numbers.",
        "",
        "## Engine micro-benchmarks (toy NanoGPT, offline engine)",
        "",
    ]
    for suite in MICRO_SUITES:
        md = reports / f"micro_{suite.replace('-', '_')}.md"
        parts += [f"### {suite}", ""]
        if md.exists():
            parts += [embed(md, out), "", READING, ""]
        else:
            parts += [f"_Not run yet: `infer bench micro {suite}`._", ""]
    parts += ["## Serving workloads and the ablation ladder", ""]
    ablation = _newest(list(reports.glob("ablation_*/ABLATION.md")))
    serve = _newest(list(reports.glob("serve_*/report.md")))
    if ablation:
        parts += [embed(ablation, out), "", READING, ""]
    elif serve:
        parts += [embed(serve, out), "", READING, ""]
    else:
        parts += ["_Not run yet: `infer bench ablation --model M`._", ""]
    parts += ["## Client-side suite (openai SDK)", ""]
    client = _newest(list(reports.glob("client_*.md")))
    if client:
        parts += [embed(client, out), "", READING, ""]
    else:
        parts += ["_Not run yet: `infer bench client --server URL`._", ""]
    return "\n".join(parts).rstrip() + "\n"
