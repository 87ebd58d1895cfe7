"""Where the browser tests leave their screenshots (.artifacts/screenshots, kept by CI)."""

from __future__ import annotations

from pathlib import Path

SCREENSHOTS = Path(__file__).resolve().parents[2] / ".artifacts" / "screenshots"
