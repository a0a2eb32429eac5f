"""The `urc` command line and the local-cluster wiring: the one package that may import every
other (core, router, backends, simulation, loadgen)."""
