"""The documents describe kvdb as it is (issue 46): no text in the repo numbers the work sessions
that built it (history lives in the git log), and no design document grows past what a reader
takes in at one sitting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".py", ".pyx", ".pxd", ".md", ".txt", ".json", ".jsonl", ".toml", ".cfg", ".ini",
                 ".yaml", ".yml", ".c", ".h", ".sh"}
#: the word session (or sessions, any case), spaces, then a number: a work session by number. An
#: identifier (``session_id``, ``sessions=3``) never matches.
SESSION_NUMBER = re.compile(r"\bsessions?\s+\d+", re.IGNORECASE)
MAX_DOC_LINES = 450


def _text_files():
    yield REPO / "README.md"
    for top in ("docs", "kvdb", "tests"):
        for p in sorted((REPO / top).rglob("*")):
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts:
                yield p


def test_no_text_numbers_a_work_session():
    bad = []
    for f in _text_files():
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        for no, line in enumerate(text.splitlines(), start=1):
            if SESSION_NUMBER.search(line):
                bad.append(f"{f.relative_to(REPO)}:{no}: {line.strip()[:100]}")
    assert not bad, ("history belongs in the git log; describe what is, not which session did it:\n"
                     + "\n".join(bad))


def test_the_pattern_tells_a_work_session_from_a_session_id():
    word = "session"  # spelled apart, so that this file passes its own test
    assert SESSION_NUMBER.search(f"measured in {word} 12")
    assert SESSION_NUMBER.search(f"{word.title()}s 27-28 tried it")
    assert SESSION_NUMBER.search(f"{word.upper()}  8's figures")
    for fine in ("session_id=3", "sessions=12", "the session's 2 agents", "db.begin_session(\"s1\")"):
        assert not SESSION_NUMBER.search(fine), fine


@pytest.mark.parametrize("path", sorted((REPO / "docs").glob("*.md")), ids=lambda p: p.name)
def test_no_design_document_is_a_lab_notebook(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_DOC_LINES, f"docs/{path.name} has {n} lines (at most {MAX_DOC_LINES}): keep what is, drop history"
