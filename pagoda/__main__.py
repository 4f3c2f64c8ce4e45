"""`python -m pagoda ...`: the same command line as the `pagoda` script (pagoda.cli)."""

import sys

from pagoda.cli import main

sys.exit(main())
