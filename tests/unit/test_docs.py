"""The settings reference (docs/reference/settings.md, written from the code at every build) is complete and true:
every setting the code knows has a meaning, each limit its real default, every check code the code emits a line."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from outbox import conf, settings_problems
from outbox.harvest.config import HarvestConfig, Limits
from outbox.kafka.keys import shown_default
from outbox.many import ENTRY_KEYS, OutboxEntry
from outbox.queue import app_settings
from outbox.queue.config import LIMIT_NAMES, QueueConfig, QueueLimits

ROOT = Path(__file__).resolve().parents[2]


def _documented(*sections: type) -> set[str]:
    return {spec.name for section in sections for spec in dataclasses.fields(section) if spec.metadata.get("doc")}


def test_every_outbox_setting_has_a_meaning() -> None:
    documented = _documented(conf.OutboxKeys, HarvestConfig, Limits) | set(conf.APP_KEYS) | set(conf.RETIRED_KEYS)
    assert conf.known_keys() - documented == set(), "settings without a meaning"
    assert documented - conf.known_keys() == set(), "meanings of settings that do not exist"


def test_each_default_is_shown_as_the_code_has_it() -> None:
    for section in (conf.OutboxKeys, HarvestConfig, Limits, OutboxEntry, QueueConfig, QueueLimits):
        for spec in dataclasses.fields(section):
            if "doc" not in spec.metadata or spec.metadata.get("shown"):
                continue  # derived, documented as a formula or a name
            default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
            assert shown_default(spec) == f"`{default!r}`".replace("'", '"'), spec.name
    assert shown_default(dataclasses.fields(Limits)[0]) == "`0.5`"


def test_every_key_of_an_outboxes_entry_has_a_meaning_on_the_page() -> None:
    assert _documented(OutboxEntry) == ENTRY_KEYS
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        from settings_reference import settings_markdown
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    entries = settings_markdown().split("## An entry of")[1].split("## Limits")[0]
    assert {name for name in ENTRY_KEYS if f"| `{name}` |" in entries} == ENTRY_KEYS


def test_every_queue_setting_has_a_meaning() -> None:
    assert _documented(QueueConfig, QueueLimits) == app_settings.KNOWN_KEYS
    assert set(LIMIT_NAMES) == _documented(QueueLimits)


def _codes_emitted(where: list[Path]) -> set[str]:
    """Every code written as a string literal ("E011", "W001") in these files, and E002 where they call
    outbox.kafka.problems.unknown_keys (which writes it for them)."""
    found = set()
    for path in where:
        text = path.read_text()
        found.update(re.findall(r'"([EW]\d{3})"', text))
        if re.search(r"\bunknown_keys\(\w", text):
            found.add("E002")
    return found


def test_every_check_code_the_code_emits_is_explained() -> None:
    queue = sorted((ROOT / "outbox" / "queue").glob("*.py"))
    rest = [path for path in (ROOT / "outbox").rglob("*.py") if path not in queue]
    assert {f"outbox.{c}" for c in _codes_emitted(rest)} | {"outbox.W002"} == set(settings_problems.CHECK_CODES)
    assert {f"outbox_queue.{c}" for c in _codes_emitted(queue)} == set(app_settings.CHECK_CODES)


def test_the_reference_page_shows_them_all() -> None:
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        from settings_reference import settings_markdown
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    page = settings_markdown()
    for name in [*conf.known_keys(), *app_settings.KNOWN_KEYS, *settings_problems.CHECK_CODES,
                 *app_settings.CHECK_CODES]:
        assert f"| `{name}` |" in page, name


#: A page and a section's title, quoted, in a docstring, a comment or a message: the section must still be there
#: (pages move).
_SECTION_CITED = re.compile(r'docs/([a-z-]+\.md),\s*(?:"\s*f?")?\\?"([^"\\]+)')


def test_every_section_the_code_cites_exists() -> None:
    headings = {page.name: [line.lstrip("#").strip().replace("`", "") for line in page.read_text().splitlines()
                            if re.match(r"#{1,4} ", line)] + re.findall(r"^- \*\*([^*]+)\*\*", page.read_text(), re.M)
                for page in (ROOT / "docs").glob("*.md")}
    missing = []
    for folder in ("outbox", "project", "tests", "monitoring"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in {".py", ".yml", ".html"} or not path.is_file():
                continue
            for page, title in _SECTION_CITED.findall(path.read_text()):
                title = re.sub(r"\s+", " ", title).replace("`", "")
                if page not in headings or not any(heading.startswith(title) for heading in headings[page]):
                    missing.append(f"{path.relative_to(ROOT)}: {page}, {title!r}")
    assert missing == [], "sections cited that no page has:\n" + "\n".join(missing)


def test_no_page_cites_an_issue_number() -> None:
    """The docs say what is, not the history of how it came to be: git keeps that."""
    cited = [f"{page.relative_to(ROOT)}:{number}: {line.strip()[:80]}"
             for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
             for number, line in enumerate(page.read_text().splitlines(), 1)
             if re.search(r"\bissues? \d+\b|\(#\d+\)", line, re.IGNORECASE)]
    assert cited == []


def test_every_code_fence_is_a_line_of_its_own() -> None:
    """A fence with prose after it (```` ``` The ... ````) opens a block instead of closing one, and every later block
    of the page pairs up the wrong way; Sphinx builds it without a warning."""
    fence = re.compile(r"\s*(`{3,}|~{3,})(.*)")
    bad = [f"{page.relative_to(ROOT)}:{number}: {line.strip()[:80]}"
           for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")]
           if "_build" not in page.parts
           for number, line in enumerate(page.read_text().splitlines(), 1)
           if (found := fence.fullmatch(line)) and " " in found.group(2).strip() and "{" not in found.group(2)]
    assert bad == []
