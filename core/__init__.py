"""The shared core both sides speak: block keys (and their C twin), the KV-event codec and
publisher, tokenizers and chat templates, the heap, cache scopes, the strict JSON parse, and
the switch between compiled and source modules (`core.native`). It imports nothing of ours."""

from core import native

native.install()
