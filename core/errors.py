"""The OpenAI-style error of the gateway and our workers: `{"error": {message, type, ...}}`, as
a status and a JSON body; the layers that serve HTTP make their own response of it."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import msgspec


@dataclass(eq=False)  # eq=False: an exception stays hashable
class APIError(Exception):
    status: int
    message: str
    _: KW_ONLY
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)  # str(error) is its message

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return msgspec.json.encode({"error": error})
