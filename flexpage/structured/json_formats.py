"""String formats of JSON schemas that llguidance accepts too loosely, as stricter patterns.

llguidance 1.9 matches ``"format": "date"`` and ``"date-time"`` with a regex that allows
February 29 of every year and the year 0000, which Python's ``date.fromisoformat`` and
``jsonschema``'s format checker refuse (bench/structured_corpus.py found a ``2023-02-29``),
and ``"time"`` / ``"date-time"`` with unbounded fractions of a second, which a small model
fills with digits until ``max_tokens``. :func:`calendar_formats` rewrites those three formats
into ``pattern`` s that know the Gregorian calendar and allow at most 9 fraction digits
(nanoseconds): every string they allow is valid under the format, so the output still
validates against the schema the client sent.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FORMAT_PATTERNS", "calendar_formats"]

_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999
# divisible by 4 and not by 100 (0004 ... 9996), or by 400 (0400 ... 9600; 0000 is no year)
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         rf"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = r"(?:(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9]))"

#: format -> the pattern that replaces it (anchored: JSON-schema patterns match anywhere)
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}[Tt]{_TIME}$"}

_VALUES = ("const", "enum", "default", "examples")  # keys whose values are data, not schemas


def calendar_formats(schema: Any) -> Any:
    """A copy of ``schema`` in which every string schema with one of :data:`FORMAT_PATTERNS`'
    formats and no ``pattern`` of its own has that pattern instead (others are left as
    they are)."""
    if isinstance(schema, list):
        return [calendar_formats(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _VALUES else calendar_formats(value) for key, value in schema.items()}
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in FORMAT_PATTERNS and "pattern" not in out and out.get("type", "string") == "string":
        del out["format"]
        out["pattern"] = FORMAT_PATTERNS[fmt]
    return out
