"""The docs' Python examples run, as a reader would paste them: every ```python block of every page, in order, in
one namespace per page (Sybil parses the pages; each page is one test). A block that cannot run as it stands (it
needs a broker of its own, an optional package, a project's own names) says so in the page with a Sybil skip
comment and its reason, which the page shows nowhere. `>>>` lines inside a block are checked as doctests."""

from __future__ import annotations

import unittest
import warnings
from doctest import ELLIPSIS, NORMALIZE_WHITESPACE
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.myst import ClearNamespaceParser, PythonCodeBlockParser, SkipParser

# the docs' examples as written: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.postgres_agnostic]

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: Generated pages (their examples are the code's own docstrings) and the build's output are not read.
PAGES = [*sorted(path for path in DOCS.rglob("*.md") if "_build" not in path.parts and path.parent.name != "reference"
                 and "```python" in path.read_text()), ROOT / "README.md"]
#: Pages whose examples stash, read or harvest: they run inside a transaction of the test database, rolled back.
NEED_DATABASE = {"testing.md", "writing.md", "tracing.md", "deploy.md", "README.md"}

SYBIL = Sybil(parsers=[PythonCodeBlockParser(doctest_optionflags=ELLIPSIS | NORMALIZE_WHITESPACE),
                       SkipParser(), ClearNamespaceParser()])


def _check(outbox: object, databases: object, where: str) -> None:
    """An OUTBOX a page shows passes `manage.py check`: no outbox error (warnings, such as a broker not named, are
    the page's business). A page whose example names more databases than the test project has defines them, unseen,
    as DATABASES; the checks read the setting only, no connection is opened."""
    from django.core import checks
    from django.test import override_settings

    overrides = {"OUTBOX": outbox} | ({"DATABASES": databases} if databases is not None else {})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Overriding setting DATABASES", UserWarning)
        with override_settings(**overrides):
            errors = [message for message in checks.run_checks()
                      if message.id and message.id.startswith("outbox") and message.level >= checks.ERROR]
    assert errors == [], f"{where}: manage.py check says " + "; ".join(f"{m.id}: {m.msg}" for m in errors)


def test_pages_are_found() -> None:
    assert len(PAGES) >= 10, PAGES


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_examples_on(page: Path, request: pytest.FixtureRequest) -> None:
    document = SYBIL.parse(page)
    if page.name in NEED_DATABASE:
        request.getfixturevalue("db")
    document.namespace["request"] = request  # for a page that shows a pytest fixture at work
    ran = skipped = 0
    for example in document.examples():
        settings_before = document.namespace.get("OUTBOX")
        try:
            example.evaluate()
        except unittest.SkipTest:
            skipped += 1
            continue
        ran += 1
        if document.namespace.get("OUTBOX") is not settings_before:
            _check(document.namespace["OUTBOX"], document.namespace.get("DATABASES"),
                   f"{page.name}, line {example.line}")
    assert ran + skipped > 0, "Sybil found none of the page's Python blocks"
