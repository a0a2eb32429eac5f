"""`python -m loadgen ...` = `urc bench ...`."""

from __future__ import annotations

import sys

from loadgen.cli import main

sys.exit(main())
