"""urc bench: a load generator for any OpenAI-compatible endpoint (docs/cli.md)."""
