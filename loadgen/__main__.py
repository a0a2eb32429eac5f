"""`python -m loadgen ...` = `urc bench ...`."""

from loadgen.cli import main

raise SystemExit(main())
