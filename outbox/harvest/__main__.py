"""`python -m outbox.harvest`: the stand-alone harvester (outbox/harvest/cli.py)."""

import sys

from outbox.harvest.cli import main

sys.exit(main())
