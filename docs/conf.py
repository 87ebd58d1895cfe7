"""The documentation site (Sphinx, MyST Markdown, furo): `make docs` builds it with warnings as errors.

The reference pages under reference/ are written from the code at every build (_ext/): the management commands'
flags from their parsers, the alerts from the rules, the settings from the settings' own declarations. Django is
set up to read them (apps and models only: no database is touched).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE / "_ext")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

project = "django-outbox-harvest"
author = "django-outbox-harvest's authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "command_reference", "alert_reference", "settings_reference",
              "metric_reference"]
html_theme = "furo"
html_title = "django-outbox-harvest"
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "README.md"]
# GitHub's anchors on every heading level, so links like operations.md#outboxqueueprocessstalled (the alert rules'
# runbook_url) resolve and are checked at build time.
myst_heading_anchors = 6
myst_heading_slug_func = "github"
myst_enable_extensions = ["colon_fence"]
# Keep "--name" as written in help texts and prose (no en dashes).
smartquotes_action = "qe"
# No network at build time, so no intersphinx: the standard library's types in signatures are not linked.
nitpick_ignore_regex = [("py:class", r"(collections\.abc|typing|datetime|uuid)\..*"),
                        ("py:class", r"outbox\..*"), ("py:class", r"Any|Mapping|Iterable|Sequence"),
                        # the engine's own types in the signatures shown: not part of the documented API
                        ("py:class", r"QueueConsumer|Delivery|HarvestConfig|Connector|events\.Event|Instruments|"
                                     r"PublishTracer")]
autodoc_typehints = "description"
