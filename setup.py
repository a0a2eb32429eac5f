"""Build hook for the optional C accelerator of block-key hashing.

The extension is optional: without a C compiler the pure-Python path in
router/blocks.py is used and gives the same keys.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "router._blockkeys",
            sources=["router/_blockkeys.c"],
            include_dirs=["third_party/xxhash"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
