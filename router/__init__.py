from core import native

native.install()
