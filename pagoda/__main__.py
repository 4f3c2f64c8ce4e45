"""`python -m pagoda ...`: the same command line as the `pagoda` script (pagoda.entrypoints.cli)."""

import sys

from pagoda.entrypoints.cli import main

sys.exit(main())
