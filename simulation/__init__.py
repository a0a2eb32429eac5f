"""The offline simulator, `urc replay` (simulation.cli): traces and workloads replayed in
virtual time through the gateway's own index and policies against emulated workers."""

from core import native

native.install()
