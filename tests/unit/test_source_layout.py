"""The source tree keeps the project's size rule (docs/design.md: small modules, none over 500 lines) and every module
states its role in a docstring: a change that breaks either fails here, not in a later review."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "corolla"
MAX_LINES = 500


def _violations(path: Path, root: Path = SRC) -> list[str]:
    text = path.read_text(encoding="utf-8")
    name = str(path.relative_to(root))
    found = []
    lines = len(text.splitlines())
    if lines > MAX_LINES:
        found.append(f"{name}: {lines} lines (limit {MAX_LINES}): split it by concept")
    if text.strip() and not ast.get_docstring(ast.parse(text)):
        found.append(f"{name}: no module docstring stating its role")
    return found


def test_every_module_is_small_and_says_its_role() -> None:
    modules = sorted(SRC.rglob("*.py"))
    assert len(modules) > 100, f"expected the corolla package under {SRC}"
    problems = [p for path in modules for p in _violations(path)]
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_long_module_without_docstring(tmp_path: Path) -> None:
    bad = tmp_path / "pkg" / "big.py"
    bad.parent.mkdir()
    bad.write_text("x = 1\n" * (MAX_LINES + 1))
    problems = _violations(bad, tmp_path)
    assert any("501 lines" in p for p in problems) and any("docstring" in p for p in problems)
