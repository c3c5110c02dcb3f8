"""The benches' running report: each line printed as it is measured (a long GPU run shows its progress) and kept
for the Markdown file written at the end."""

from __future__ import annotations


def log(lines: list[str], text: str) -> None:
    print(text, flush=True)
    lines.append(text)
