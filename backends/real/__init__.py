"""Launchers of real engines (vLLM, SGLang) as worker processes."""
