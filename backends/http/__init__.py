"""The HTTP layer our workers share: OpenAI's and SGLang's APIs over any engine."""
