"""The emulated GPU worker: a real radix KV cache with modelled time (see engine.py)."""
