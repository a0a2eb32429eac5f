"""urc bench: a load generator for any OpenAI-compatible endpoint (docs/cli.md).

workloads.py  seeded RequestSpec streams (pure; the simulator reuses them)
text.py       deterministic filler text of an exact byte-tokenizer length
sessions.py   SessionQueue: send order and multi-turn chaining from actual replies (pure)
mooncake.py   Mooncake JSONL traces -> RequestSpecs with hash-id-shared text
results.py    RequestResult, error kinds, the x-urc-route header
client.py     one streamed request (SSE, usage, TTFT, headers)
runner.py     the async engine: closed loop, Poisson or trace-timed open loop
report.py     summary (the --json schema) and the terminal table
cli.py        `urc bench`
"""
