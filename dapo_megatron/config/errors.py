"""The one error type for bad configuration: it always names the key to change."""
from __future__ import annotations


class ConfigError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key
