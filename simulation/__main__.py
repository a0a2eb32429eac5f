"""`python -m simulation` is `urc replay`."""

from simulation.cli import main

raise SystemExit(main())
