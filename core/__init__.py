"""The shared core both sides speak (docs/README.md); `core.native` picks compiled or source."""

from core import native

native.install()
