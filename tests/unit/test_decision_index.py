"""docs/decisions/README.md indexes every decision record: a record missing from it cannot be found from the index
that docs/design.md points readers to."""

from __future__ import annotations

import re
from pathlib import Path

DECISIONS = Path(__file__).resolve().parents[2] / "docs" / "decisions"


def test_every_decision_record_is_in_the_index() -> None:
    index = (DECISIONS / "README.md").read_text()
    records = sorted(p.name for p in DECISIONS.glob("[0-9][0-9][0-9][0-9]-*.md"))
    assert records
    assert [name for name in records if f"]({name})" not in index] == []
    # and every link of the index names a record that exists
    assert [name for name in re.findall(r"\]\((\d{4}-[^)]+\.md)\)", index) if name not in records] == []
