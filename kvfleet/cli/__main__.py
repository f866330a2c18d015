"""``python -m kvfleet.cli``: the `kvfleet` command."""

import sys

from kvfleet.cli import main

sys.exit(main())
