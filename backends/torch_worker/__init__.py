"""The torch worker: a Llama decoder with SGLang-style radix attention over shared KV pages."""
