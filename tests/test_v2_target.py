"""The list of deliberate deviations from tritonserver 2.51 is one table, kept true: every key
of tests/v2_target.py DEVIATIONS has a row in docs/triton-conformance.md and is asserted by a
test, and the table has no other rows."""

from __future__ import annotations

import re
from pathlib import Path

from tests.v2_target import DEVIATIONS

ROOT = Path(__file__).resolve().parent.parent


def test_every_deviation_is_documented_once_and_tested():
    doc = (ROOT / "docs" / "triton-conformance.md").read_text()
    section = doc.split("## Deviations", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", section, re.M)
    assert sorted(rows) == sorted(DEVIATIONS), "docs/triton-conformance.md and DEVIATIONS differ"
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py")
                    if p.name != Path(__file__).name)
    untested = [k for k in DEVIATIONS if f'"{k}"' not in tests]
    assert not untested, f"deviations no test asserts: {untested}"
