"""`python -m loadgen ...` = `urc bench ...`."""

import sys

from loadgen.cli import main

sys.exit(main())
