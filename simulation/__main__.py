"""`python -m simulation` is `urc replay`."""

import sys

from simulation.cli import main

sys.exit(main())
