"""The offline simulator (`urc replay`): traces and workloads replayed in virtual time through
the gateway's own index and policies against emulated workers. Entry points: `simulation.cli`
(`add_arguments`, `build_parser`, `run`, `main`) and `simulation.compare.compare`."""

from core import native

native.install()
