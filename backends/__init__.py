from router import native

native.install()
