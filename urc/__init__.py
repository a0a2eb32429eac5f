"""The `urc` command line and the local-cluster wiring: the one package that imports them all."""
