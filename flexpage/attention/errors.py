"""Loud, specific input errors: every message names the argument, the value and what was expected."""

from __future__ import annotations

from typing import Any


def check_arg(ok: bool, name: str, value: Any, expected: str) -> None:
    """Raise ``ValueError`` naming ``name`` and ``value`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}: got {value!r}, expected {expected}")
