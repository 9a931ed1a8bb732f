"""``python -m portattn.conformance check|conformance ...`` (same as the ``portattn`` command)."""
import sys

from .cli import main

sys.exit(main())
