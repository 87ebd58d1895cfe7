"""`python -m outbox.pipeline --topics T --out DIR`: the audit without Django (see cli.py)."""

import sys

from outbox.pipeline.cli import main

sys.exit(main())
