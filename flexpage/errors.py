"""Errors flexpage raises for a caller's bad input."""

from __future__ import annotations

__all__ = ["InvalidParameter"]


class InvalidParameter(ValueError):
    """A request value that is wrong; ``param`` names the field (the server's OpenAI error
    ``param``), set where the check is made rather than recovered from the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
