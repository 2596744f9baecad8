"""Shared results file: each benchmark owns one marked section of ``benchmarks/RESULTS.md``."""

from __future__ import annotations

from pathlib import Path

HEADER = "# Benchmark results\n\nEach section is written by the script named in it; rerun the script to refresh it.\n"


def write_section(name: str, markdown: str, path: str | Path = "benchmarks/RESULTS.md") -> None:
    """Replace the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->``, appending the section if absent."""
    path = Path(path)
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = path.read_text() if path.exists() else HEADER
    if begin in text and end in text.split(begin, 1)[1]:
        before, rest = text.split(begin, 1)
        after = rest.split(end, 1)[1]
        text = before + block + after
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
