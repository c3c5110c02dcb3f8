"""Training text for the demo model: English prose that ships with Python (reference manual topics, stdlib docstrings)."""

from __future__ import annotations

import ast
import pydoc_data.topics
import re
import sysconfig
from pathlib import Path

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

_MIN_PARAGRAPH_CHARS = 80
_MIN_PROSE_SHARE = 0.85  # share of letters and spaces below which a paragraph is mostly code or grammar
_RULE_CHARS = set("*=-~^")
_ASCII_REPLACEMENTS = {"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2014": "-", "\u2013": "-"}
_DOCSTRING_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _unwrap(block: str) -> str | None:
    """Joins a wrapped paragraph into one line; None for code, grammar, headings and short or non-ASCII text."""
    lines = [line for line in block.split("\n") if line.strip()]
    if not lines or any(line.startswith((" ", "\t", ">>>")) for line in lines):
        return None  # indented: code sample, grammar rule or list continuation
    if any(set(line.strip()) <= _RULE_CHARS for line in lines):
        return None  # a heading underlined with a rule
    text = re.sub(r"\s+", " ", " ".join(lines)).strip()
    for old, new in _ASCII_REPLACEMENTS.items():
        text = text.replace(old, new)
    if len(text) < _MIN_PARAGRAPH_CHARS or not text.isascii():
        return None
    if sum(ch.isalpha() or ch == " " for ch in text) / len(text) < _MIN_PROSE_SHARE:
        return None
    return text


def _manual_blocks() -> list[str]:
    """Raw paragraphs of the reference manual topics bundled with Python (`pydoc_data.topics`)."""
    topics = pydoc_data.topics.topics
    return [block for name in sorted(topics) for block in re.split(r"\n\s*\n", topics[name])]


def _docstring_blocks(stdlib_dir: Path) -> list[str]:
    """Raw paragraphs of the module, class and function docstrings of the top-level stdlib modules."""
    blocks: list[str] = []
    for path in sorted(stdlib_dir.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, _DOCSTRING_NODES) and (doc := ast.get_docstring(node)):
                blocks.extend(re.split(r"\n\s*\n", doc))
    return blocks


def prose_paragraphs() -> list[str]:
    """Unique prose paragraphs, manual first then docstrings, in a fixed order for a given Python version."""
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    paragraphs: list[str] = []
    seen: set[str] = set()
    for block in _manual_blocks() + _docstring_blocks(stdlib_dir):
        text = _unwrap(block)
        if text is not None and text not in seen:
            seen.add(text)
            paragraphs.append(text)
    logger.info(f"corpus.built(paragraphs={len(paragraphs)}, chars={sum(map(len, paragraphs))}, stdlib={stdlib_dir})")
    return paragraphs
