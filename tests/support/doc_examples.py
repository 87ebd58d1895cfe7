"""A page's example, to run where a test has what the page assumes (a Spark audit's tables, say)."""

from __future__ import annotations

import re
from pathlib import Path


def python_block(page: Path, containing: str) -> str:
    """The one ```python block of `page` that contains `containing`."""
    blocks = [block for block in re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.M | re.S)
              if containing in block]
    assert len(blocks) == 1, f"{page.name}: {len(blocks)} Python blocks contain {containing!r}"
    return blocks[0]
