"""The shared core both sides speak (docs/README.md lists its modules); it imports nothing of
ours. `core.native` switches between the compiled modules and their source."""

from core import native

native.install()
