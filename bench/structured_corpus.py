"""Structured outputs validation corpus: every output of every constraint checked, one run.

    python -m bench.structured_corpus [--quick] [--max-tokens 256] [--batch 64] [--out PATH]

A corpus of constraints written as data -- 55 JSON schemas (nested objects, arrays with
min/maxItems, enums, const, anyOf/oneOf, $ref/$defs, string formats, patterns, numbers with
bounds and multipleOf, additionalProperties false, required subsets, nullable fields), 22
regexes, 12 choice lists and 7 grammars (GBNF and Lark) -- each with a chat prompt that asks
for it. Every constraint is requested 4-6 times with different sampling (greedy; temperature
0.7-1.0 with a seed, n = 1-3), ~540 requests and ~950 outputs through ``LLM.chat`` in
batches, and every output is checked with a library that knows nothing of llguidance:

* schemas: ``jsonschema`` (Draft 2020-12) with a format checker (:data:`FORMATS`: strict
  RFC 3339 date/time/date-time, uuid, ipv4/6, hostname, uri, email, duration);
* regexes: Python's ``re.fullmatch`` (the corpus uses only syntax whose Rust ``regex`` and
  Python ``re`` meanings agree: no ``\\d``/``\\w``, no lookaround, explicit classes);
* choices: membership;
* grammars: a hand-written recursive-descent parser or an equivalent regex per grammar
  (``lark`` is not installed in the environment).

An output that stops at ``max_tokens`` (``finish_reason == "length"``) is counted apart: the
grammar held, the output is merely cut. Everything else that fails to parse or validate is a
failure, listed with its finish_reason, text and the validator's message. The count per
kind and the failures go to --out (bench/results/structured_corpus.json). ``--quick``: a
few constraints of each kind, one request each.

The data (:data:`SCHEMAS`, :data:`REGEXES`, :data:`CHOICES`, :data:`GRAMMARS`) and
:func:`check` are also used by tests/test_structured_corpus.py and bench/structured.py.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable

import jsonschema

DEFAULT_OUT = Path("bench/results/structured_corpus.json")

# --------------------------------------------------------------------------- JSON schemas

_S = {"type": "string"}


def _str(max_length: int = 30, min_length: int = 1, **extra: Any) -> dict:
    return {"type": "string", "minLength": min_length, "maxLength": max_length, **extra}


def _obj(properties: dict, required: list[str] | None = None, closed: bool = True, **extra: Any) -> dict:
    schema = {"type": "object", "properties": properties,
              "required": list(properties) if required is None else required, **extra}
    if closed:
        schema["additionalProperties"] = False
    return schema


def _num(minimum: float, maximum: float, step: float, **extra: Any) -> dict:
    """A number with bounds and at most as many decimals as ``step`` has (``multipleOf``): a
    small model left free writes digits until ``max_tokens``."""
    return {"type": "number", "minimum": minimum, "maximum": maximum, "multipleOf": step, **extra}


_DATE_TIME = {"type": "string", "format": "date-time", "maxLength": 32}  # bounded fraction of a second


_ADDRESS = _obj({"street": _str(40), "city": _str(25), "zip": _str(pattern=r"^[0-9]{5}$"),
                 "country": {"enum": ["US", "CA", "MX", "GB", "DE", "FR", "JP"]}})
_MONEY = _num(0, 100000, 0.01)

#: (name, what the prompt asks for, schema); the first twelve are bench/structured.py's
SCHEMAS: list[tuple[str, str, dict]] = [
    # --- the dozen bench/structured.py times (realistic, one feature family each) ---
    ("person", "a fictional person with name, age and email",
     _obj({"name": _str(30), "age": {"type": "integer", "minimum": 0, "maximum": 120},
           "email": {"type": "string", "format": "email", "maxLength": 40}})),
    ("address_book", "a contact with a name and one or two postal addresses",
     _obj({"name": _str(30), "addresses": {"type": "array", "items": _ADDRESS, "minItems": 1, "maxItems": 2}})),
    ("order", "a shop order with an id, a date, line items and a total",
     _obj({"order_id": {"type": "string", "format": "uuid"}, "date": {"type": "string", "format": "date"},
           "items": {"type": "array", "minItems": 1, "maxItems": 3,
                     "items": _obj({"sku": _str(pattern=r"^[A-Z]{3}-[0-9]{4}$"),
                                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                                    "price": _MONEY})},
           "total": _MONEY})),
    ("ticket", "a support ticket with priority, status and tags",
     _obj({"title": _str(50), "priority": {"enum": ["low", "medium", "high", "urgent"]},
           "status": {"enum": ["open", "pending", "closed"]},
           "tags": {"type": "array", "items": _str(15), "maxItems": 4}})),
    ("shape", "a geometric shape: a circle with a radius or a rectangle with width and height",
     {"anyOf": [_obj({"kind": {"const": "circle"}, "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000, "multipleOf": 0.1}}),
                _obj({"kind": {"const": "rectangle"}, "width": _num(0, 1000, 0.1),
                      "height": _num(0, 1000, 0.1)})]}),
    ("event", "a calendar event with a start and end date-time, a location and attendees' emails",
     _obj({"name": _str(40), "start": _DATE_TIME,
           "end": _DATE_TIME, "location": _str(40),
           "attendees": {"type": "array", "items": {"type": "string", "format": "email", "maxLength": 40},
                         "maxItems": 3}},
          required=["name", "start", "end"])),
    ("sensor", "a sensor reading with bounded temperature, humidity and a battery level",
     _obj({"sensor_id": _str(pattern=r"^S[0-9]{3}$"),
           "temperature_c": _num(-40, 85, 0.1),
           "humidity": _num(0, 100, 0.1),
           "battery": {"type": "integer", "minimum": 0, "maximum": 100}})),
    ("tree", "a file system folder with files and at most one level of subfolders",
     {"$defs": {"file": _obj({"name": _str(20), "bytes": {"type": "integer", "minimum": 0, "maximum": 10**9}}),
                "leaf": _obj({"name": _str(20), "files": {"type": "array", "items": {"$ref": "#/$defs/file"},
                                                          "maxItems": 2}})},
      **_obj({"name": _str(20), "files": {"type": "array", "items": {"$ref": "#/$defs/file"}, "maxItems": 2},
              "folders": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2}})}),
    ("recipe", "a cooking recipe with ingredients, steps and a difficulty",
     _obj({"title": _str(40), "servings": {"type": "integer", "minimum": 1, "maximum": 12},
           "difficulty": {"enum": ["easy", "medium", "hard"]},
           "ingredients": {"type": "array", "minItems": 1, "maxItems": 5,
                           "items": _obj({"name": _str(25), "amount": _str(15)})},
           "steps": {"type": "array", "items": _str(60), "minItems": 1, "maxItems": 4}})),
    ("payment", "a payment made by card or by bank transfer",
     {"oneOf": [_obj({"method": {"const": "card"}, "last4": _str(pattern=r"^[0-9]{4}$"), "amount": _MONEY}),
                _obj({"method": {"const": "transfer"}, "iban": _str(34, 15, pattern=r"^[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}$"),
                      "amount": _MONEY})]}),
    ("server_config", "a server configuration with host, port, TLS settings and optional limits",
     _obj({"host": {"type": "string", "format": "hostname", "maxLength": 40},
           "port": {"type": "integer", "minimum": 1, "maximum": 65535},
           "tls": _obj({"enabled": {"type": "boolean"}, "min_version": {"enum": ["1.2", "1.3"]}}),
           "limits": _obj({"max_connections": {"type": "integer", "minimum": 1, "maximum": 100000},
                           "timeout_s": _num(0.1, 600, 0.1)}, required=[])},
          required=["host", "port", "tls"])),
    ("review", "a product review with a rating, pros, cons and a nullable reply",
     _obj({"product": _str(30), "rating": {"type": "integer", "minimum": 1, "maximum": 5},
           "pros": {"type": "array", "items": _str(30), "maxItems": 3},
           "cons": {"type": "array", "items": _str(30), "maxItems": 3},
           "reply": {"anyOf": [_str(60), {"type": "null"}]}})),
    # --- the rest of the corpus ---
    ("boolean_flags", "feature flags as booleans",
     _obj({"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"}, "telemetry": {"type": "boolean"}})),
    ("single_int", "a single integer between 1 and 10", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("single_enum", "a traffic light colour", {"enum": ["red", "amber", "green"]}),
    ("int_array", "a list of 3 to 6 lottery numbers between 1 and 49",
     {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 49}, "minItems": 3, "maxItems": 6}),
    ("string_array", "a list of two to four city names", {"type": "array", "items": _str(20), "minItems": 2, "maxItems": 4}),
    ("tuple", "a point as [x, y, label]",
     {"type": "array", "prefixItems": [_num(-100, 100, 0.01), _num(-100, 100, 0.01), _str(10)],
      "items": False, "minItems": 3}),
    ("matrix", "a 2x2 matrix of small integers",
     {"type": "array", "minItems": 2, "maxItems": 2,
      "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}),
    ("book", "a book with title, author, ISBN and publication year",
     _obj({"title": _str(50), "author": _str(30), "isbn": _str(pattern=r"^97[89][0-9]{10}$"),
           "year": {"type": "integer", "minimum": 1450, "maximum": 2030}})),
    ("movie", "a movie with genres and a rating out of 10",
     _obj({"title": _str(40), "genres": {"type": "array", "minItems": 1, "maxItems": 3,
                                         "items": {"enum": ["action", "comedy", "drama", "horror", "sci-fi", "romance"]}},
           "rating": _num(0, 10, 0.1)})),
    ("weather", "a weather forecast for three days",
     _obj({"city": _str(25), "days": {"type": "array", "minItems": 3, "maxItems": 3,
                                      "items": _obj({"date": {"type": "string", "format": "date"},
                                                     "high_c": {"type": "integer", "minimum": -50, "maximum": 55},
                                                     "low_c": {"type": "integer", "minimum": -60, "maximum": 50},
                                                     "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}})}})),
    ("employee", "an employee record with a manager who is also an employee (no deeper)",
     {"$defs": {"person": _obj({"name": _str(30), "title": _str(30)})},
      **_obj({"name": _str(30), "title": _str(30), "manager": {"anyOf": [{"$ref": "#/$defs/person"}, {"type": "null"}]}})}),
    ("login", "a login attempt with a username, an IPv4 address and a timestamp",
     _obj({"username": _str(20, pattern=r"^[a-z][a-z0-9_]{0,19}$"), "ip": {"type": "string", "format": "ipv4"},
           "at": _DATE_TIME, "success": {"type": "boolean"}})),
    ("network", "a network interface with an IPv6 address and an MTU",
     _obj({"name": _str(10), "ipv6": {"type": "string", "format": "ipv6"},
           "mtu": {"type": "integer", "minimum": 576, "maximum": 9000}})),
    ("link", "a bookmark with a title and a URI",
     _obj({"title": _str(40), "uri": {"type": "string", "format": "uri", "maxLength": 60}})),
    ("alarm", "an alarm with a time of day and the weekdays it rings on",
     _obj({"time": {"type": "string", "format": "time", "maxLength": 18},
           "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                    "minItems": 1, "maxItems": 7}})),
    ("subscription", "a subscription with a plan, a trial length as an ISO 8601 duration, and a renewal flag",
     _obj({"plan": {"enum": ["free", "pro", "team"]}, "trial": {"type": "string", "format": "duration", "maxLength": 12},
           "auto_renew": {"type": "boolean"}})),
    ("user_uuid", "a user with a UUID and a display name",
     _obj({"id": {"type": "string", "format": "uuid"}, "display_name": _str(25)})),
    ("optional_fields", "a profile where only the username is required",
     _obj({"username": _str(20), "bio": _str(80), "website": _str(40), "age": {"type": "integer", "minimum": 13, "maximum": 120}},
          required=["username"])),
    ("required_subset", "a car with make and model required and colour and year optional",
     _obj({"make": _str(20), "model": _str(20), "colour": _str(15), "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
          required=["make", "model"])),
    ("open_object", "a small dictionary of word counts (word to count)",
     {"type": "object", "patternProperties": {"^[a-z]{1,15}$": {"type": "integer", "minimum": 0, "maximum": 1000}},
      "additionalProperties": False, "maxProperties": 4}),
    ("nullable", "a task whose due date may be null",
     _obj({"task": _str(40), "due": {"type": ["string", "null"], "format": "date"}, "done": {"type": "boolean"}})),
    ("multiple_of", "a time slot in minutes that is a multiple of 15, and a count that is even",
     _obj({"minutes": {"type": "integer", "multipleOf": 15, "minimum": 0, "maximum": 1440},
           "count": {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 100}})),
    ("exclusive_bounds", "a probability strictly between 0 and 1 and a positive weight",
     _obj({"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1, "multipleOf": 0.001},
           "weight": {"type": "number", "exclusiveMinimum": 0, "maximum": 500, "multipleOf": 0.01}})),
    ("negative_numbers", "a bank balance that may be negative and an overdraft limit",
     _obj({"balance": _num(-10000, 10000, 0.01),
           "overdraft_limit": {"type": "integer", "minimum": -5000, "maximum": 0}})),
    ("const_version", "an API response with version 2 and a status code",
     _obj({"api_version": {"const": 2}, "code": {"enum": [200, 201, 400, 404, 500]}, "message": _str(40)})),
    ("mixed_enum", "a setting whose value is one of a few mixed constants",
     _obj({"key": _str(20), "value": {"enum": ["auto", 0, 1, True, None]}})),
    ("geo", "a GeoJSON point",
     _obj({"type": {"const": "Point"},
           "coordinates": {"type": "array", "prefixItems": [_num(-180, 180, 0.0001), _num(-90, 90, 0.0001)],
                           "items": False, "minItems": 2}})),
    ("animal", "an animal that is either a dog with a breed, a cat that is indoor or not, or a fish with a tank size",
     {"oneOf": [_obj({"species": {"const": "dog"}, "breed": _str(25)}),
                _obj({"species": {"const": "cat"}, "indoor": {"type": "boolean"}}),
                _obj({"species": {"const": "fish"}, "tank_litres": {"type": "integer", "minimum": 1, "maximum": 2000}})]}),
    ("number_or_string", "an identifier that is either a number or a short code",
     _obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10**6}, _str(8, pattern=r"^[A-Z0-9]{4,8}$")]}})),
    ("invoice", "an invoice with a customer address, line items and tax rate",
     {"$defs": {"address": _ADDRESS, "line": _obj({"description": _str(40), "qty": {"type": "integer", "minimum": 1, "maximum": 100},
                                                   "unit_price": _MONEY})},
      **_obj({"invoice_no": _str(pattern=r"^INV-[0-9]{6}$"), "customer": {"$ref": "#/$defs/address"},
              "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1, "maxItems": 3},
              "tax_rate": _num(0, 0.3, 0.001)})}),
    ("quiz", "a multiple-choice quiz question with four options and the index of the answer",
     _obj({"question": _str(80), "options": {"type": "array", "items": _str(30), "minItems": 4, "maxItems": 4},
           "answer": {"type": "integer", "minimum": 0, "maximum": 3}})),
    ("translation", "a word translated into three languages",
     _obj({"word": _str(20), "translations": _obj({"fr": _str(20), "de": _str(20), "es": _str(20)})})),
    ("chat_message", "a chat message with a role, content and an optional list of tool calls",
     _obj({"role": {"enum": ["user", "assistant", "system", "tool"]}, "content": _str(80),
           "tool_calls": {"type": "array", "maxItems": 2,
                          "items": _obj({"name": _str(20, pattern=r"^[a-z_]{1,20}$"),
                                         "arguments": _obj({"query": _str(40)}, required=[])})}},
          required=["role", "content"])),
    ("color", "a colour as a hex code and its RGB components",
     _obj({"hex": _str(7, 7, pattern=r"^#[0-9a-f]{6}$"), "rgb": {"type": "array", "minItems": 3, "maxItems": 3,
                                                                "items": {"type": "integer", "minimum": 0, "maximum": 255}}})),
    ("flight", "a flight with airline code, flight number, departure and arrival airports and times",
     _obj({"flight": _str(6, 3, pattern=r"^[A-Z]{2}[0-9]{1,4}$"),
           "from": _str(3, 3, pattern=r"^[A-Z]{3}$"), "to": _str(3, 3, pattern=r"^[A-Z]{3}$"),
           "departs": _DATE_TIME, "seats_left": {"type": "integer", "minimum": 0, "maximum": 400}})),
    ("git_commit", "a git commit with a short hash, an author email and a message",
     _obj({"hash": _str(7, 7, pattern=r"^[0-9a-f]{7}$"), "author": {"type": "string", "format": "email", "maxLength": 40},
           "message": _str(72), "files_changed": {"type": "integer", "minimum": 1, "maximum": 500}})),
    ("http_request", "an HTTP request with a method, a path, headers and an optional body",
     _obj({"method": {"enum": ["GET", "POST", "PUT", "DELETE", "PATCH"]}, "path": _str(40, pattern=r"^/[a-z0-9/_-]{0,39}$"),
           "headers": {"type": "object", "patternProperties": {"^[A-Za-z][A-Za-z-]{0,19}$": _str(40)},
                       "additionalProperties": False, "maxProperties": 3},
           "body": {"anyOf": [_str(60), {"type": "null"}]}}, required=["method", "path", "headers"])),
    ("inventory", "a warehouse inventory with two to four items and their stock levels",
     _obj({"warehouse": _str(20), "items": {"type": "array", "minItems": 2, "maxItems": 4,
                                            "items": _obj({"name": _str(25), "stock": {"type": "integer", "minimum": 0, "maximum": 9999},
                                                           "reorder": {"type": "boolean"}})}})),
    ("deep_nesting", "a company with departments, each with teams, each with members",
     _obj({"company": _str(25), "departments": {"type": "array", "minItems": 1, "maxItems": 2, "items": _obj({
         "name": _str(20), "teams": {"type": "array", "minItems": 1, "maxItems": 2, "items": _obj({
             "name": _str(20), "members": {"type": "array", "items": _str(20), "minItems": 1, "maxItems": 3}})}})}})),
    ("allof", "a named entity with a creation date (two schemas combined)",
     {"allOf": [_obj({"name": _str(30), "created": {"type": "string", "format": "date"}}),
                {"properties": {"name": {"pattern": "^[A-Z]"}, "created": {"pattern": "^20"}}}]}),
    ("pattern_codes", "a product with a barcode, a colour code and a size code",
     _obj({"barcode": _str(13, 13, pattern=r"^[0-9]{13}$"), "colour_code": _str(pattern=r"^C-[A-F]{2}$"),
           "size": _str(pattern=r"^(XS|S|M|L|XL|XXL)$")})),
    ("student", "a student with grades in three subjects",
     _obj({"name": _str(30), "grades": _obj({"math": {"type": "integer", "minimum": 0, "maximum": 100},
                                            "physics": {"type": "integer", "minimum": 0, "maximum": 100},
                                            "history": {"type": "integer", "minimum": 0, "maximum": 100}}),
           "graduated": {"type": "boolean"}})),
    ("key_value_list", "a list of one to four key/value settings where values are strings, numbers or booleans",
     {"type": "array", "minItems": 1, "maxItems": 4,
      "items": _obj({"key": _str(15), "value": {"type": ["string", "number", "boolean"], "maxLength": 20}})}),
    ("pattern_properties", "a non-empty map of country codes to capital cities",
     {"type": "object", "patternProperties": {"^[A-Z]{2}$": _str(20)}, "additionalProperties": False,
      "minProperties": 1, "maxProperties": 3}),
    ("timeline", "a project timeline of two to three milestones with dates and completion percentages",
     _obj({"project": _str(30), "milestones": {"type": "array", "minItems": 2, "maxItems": 3,
                                               "items": _obj({"name": _str(30), "due": {"type": "string", "format": "date"},
                                                              "percent": _num(0, 100, 0.1)})}})),
    ("empty_ok", "a shopping list, possibly empty", _obj({"items": {"type": "array", "items": _str(20), "maxItems": 5}})),
]

# --------------------------------------------------------------------------- regexes, choices

_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"

#: (name, what the prompt asks for, regex in the subset where Rust and Python agree)
REGEXES: list[tuple[str, str, str]] = [
    ("phone", "a US phone number", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("zip", "a US ZIP code, optionally ZIP+4", r"[0-9]{5}(-[0-9]{4})?"),
    ("iso_date", "a date in ISO format", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("time24", "a time of day in 24-hour format", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("hex_color", "a hex colour code", r"#[0-9a-fA-F]{6}"),
    ("ipv4", "an IPv4 address", rf"({_OCTET}\.){{3}}{_OCTET}"),
    ("email", "an email address", r"[a-z0-9._]{1,20}@[a-z0-9]{1,15}\.(com|org|net|io)"),
    ("semver", "a semantic version number", r"(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})"),
    ("price", "a price in dollars", r"\$[0-9]{1,4}\.[0-9]{2}"),
    ("yes_no_reason", "a yes or no answer with a short reason", r"(Yes|No), [a-z ]{5,60}\."),
    ("full_name", "a person's first and last name", r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,15}"),
    ("uuid4", "a random UUID", r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"),
    ("url", "a website URL", r"https://(www\.)?[a-z0-9-]{2,20}\.(com|org|dev)(/[a-z0-9-]{1,15}){0,3}"),
    ("key_values", "a few settings as key=value pairs separated by semicolons",
     r"[a-z]{1,10}=[0-9]{1,5}(;[a-z]{1,10}=[0-9]{1,5}){0,4}"),
    ("stars", "a rating like 4/5 stars", r"[1-5]/5 stars"),
    ("masked_card", "a masked credit card number showing the last four digits", r"\*{4}-\*{4}-\*{4}-[0-9]{4}"),
    ("plate", "a licence plate", r"[A-Z]{3}-[0-9]{3,4}"),
    ("markdown", "a markdown heading and one short paragraph", r"# [A-Za-z ]{3,30}\n\n[A-Za-z ,.]{10,120}"),
    ("coords", "latitude and longitude", r"-?[0-9]{1,2}\.[0-9]{4}, -?[0-9]{1,3}\.[0-9]{4}"),
    ("hashtags", "one to five hashtags", r"#[a-z]{2,15}( #[a-z]{2,15}){0,4}"),
    ("isbn13", "an ISBN-13 with hyphens", r"97[89]-[0-9]-[0-9]{3}-[0-9]{5}-[0-9]"),
    ("byte", "a byte in binary", r"[01]{8}"),
]

#: (name, what the prompt asks for, the choices)
CHOICES: list[tuple[str, str, list[str]]] = [
    ("sentiment", "the sentiment of 'I loved this film'", ["positive", "negative", "neutral"]),
    ("yes_no", "whether the sky is blue", ["yes", "no"]),
    ("weekday", "a day of the week", ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]),
    ("planet", "the largest planet", ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]),
    ("http_method", "the HTTP method to create a resource", ["GET", "POST", "PUT", "PATCH", "DELETE"]),
    ("prefixes", "a word about cats", ["cat", "catalog", "category", "caterpillar"]),
    ("cities", "a city in India or the US", ["New York", "New Delhi", "New Orleans", "Newark"]),
    ("sizes", "a T-shirt size", ["XS", "S", "M", "L", "XL", "XXL"]),
    ("priority", "the priority of a server outage", ["P0 - critical", "P1 - high", "P2 - medium", "P3 - low"]),
    ("language", "a programming language for data science", ["Python", "R", "Julia", "MATLAB", "SQL"]),
    ("punctuated", "a greeting", ["Hello!", "Hi there.", "Good morning, friend.", "Hey?"]),
    ("numbers", "a prime number under 20", ["2", "3", "5", "7", "11", "13", "17", "19"]),
]

# --------------------------------------------------------------------------- grammars


class _Parser:
    """A tiny recursive-descent helper: ``eat`` literals or regexes at a position."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def peek(self, literal: str) -> bool:
        return self.text.startswith(literal, self.pos)

    def eat(self, literal: str) -> bool:
        if self.peek(literal):
            self.pos += len(literal)
            return True
        return False

    def eat_re(self, pattern: str) -> bool:
        match = re.compile(pattern).match(self.text, self.pos)
        if match and match.end() > self.pos:
            self.pos = match.end()
            return True
        return False

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"expected {what} at {self.pos}: {self.text[self.pos:self.pos + 20]!r}")

    def done(self) -> None:
        self.expect(self.pos == len(self.text), "the end")


def _check_arithmetic(text: str) -> None:
    p = _Parser(text)

    def expr() -> None:
        term()
        while p.eat("+") or p.eat("-"):
            term()

    def term() -> None:
        factor()
        while p.eat("*") or p.eat("/"):
            factor()

    def factor() -> None:
        if p.eat("("):
            expr()
            p.expect(p.eat(")"), "')'")
        else:
            p.expect(p.eat_re(r"[0-9]{1,3}(?![0-9])"), "a number of 1-3 digits")

    expr()
    p.done()


def _check_sexpr(text: str) -> None:
    p = _Parser(text)

    def sexpr() -> None:
        if p.eat("("):
            sexpr()
            while p.eat(" "):
                sexpr()
            p.expect(p.eat(")"), "')'")
        else:
            p.expect(p.eat_re(r"[a-z]{1,8}(?![a-z])") or p.eat_re(r"[0-9]{1,4}(?![0-9])"), "an atom")

    sexpr()
    p.done()


def _check_boolean(text: str) -> None:
    p = _Parser(text)

    def disj() -> None:
        conj()
        while p.eat(" or "):
            conj()

    def conj() -> None:
        atom()
        while p.eat(" and "):
            atom()

    def atom() -> None:
        if p.eat("not "):
            atom()
        elif p.eat("("):
            disj()
            p.expect(p.eat(")"), "')'")
        else:
            p.expect(p.eat("true") or p.eat("false"), "true or false")

    disj()
    p.done()


def _regex_check(pattern: str) -> Callable[[str], None]:
    compiled = re.compile(pattern)

    def check(text: str) -> None:
        if compiled.fullmatch(text) is None:
            raise ValueError(f"does not match {pattern!r}")

    return check


#: (name, what the prompt asks for, grammar text (GBNF or Lark), a checker that raises ValueError)
GRAMMARS: list[tuple[str, str, str, Callable[[str], None]]] = [
    ("arithmetic_gbnf", "an arithmetic expression using + - * / and parentheses",
     'root ::= expr\n'
     'expr ::= term (("+" | "-") term){0,3}\n'
     'term ::= factor (("*" | "/") factor){0,3}\n'
     'factor ::= num | "(" inner ")"\n'
     'inner ::= num (("+" | "-" | "*" | "/") num){0,3}\n'
     'num ::= [0-9] | [1-9] [0-9] | [1-9] [0-9] [0-9]\n', _check_arithmetic),
    ("word_list_gbnf", "a JSON-like list of one to five lowercase words",
     'root ::= "[" item (", " item)? (", " item)? (", " item)? (", " item)? "]"\n'
     'item ::= "\\"" [a-z] [a-z]? [a-z]? [a-z]? [a-z]? [a-z]? [a-z]? [a-z]? "\\""\n',
     _regex_check(r'\["[a-z]{1,8}"(, "[a-z]{1,8}"){0,4}\]')),
    ("sql_gbnf", "a simple SQL query over a users table",
     'root ::= "SELECT " cols " FROM " table where? ";"\n'
     'cols ::= "*" | col (", " col)?\n'
     'col ::= "id" | "name" | "email" | "age"\n'
     'table ::= "users" | "orders"\n'
     'where ::= " WHERE " col " = " [0-9] [0-9]?\n',
     _regex_check(r"SELECT (\*|(id|name|email|age)(, (id|name|email|age))?) FROM (users|orders)"
                  r"( WHERE (id|name|email|age) = [0-9]{1,2})?;")),
    ("csv_gbnf", "two to four rows of three comma-separated numbers",
     'root ::= row "\\n" row ("\\n" row)? ("\\n" row)?\n'
     'row ::= num "," num "," num\n'
     'num ::= [0-9] | [1-9] [0-9] | [1-9] [0-9] [0-9]\n',
     _regex_check(r"([0-9]|[1-9][0-9]{1,2}),([0-9]|[1-9][0-9]{1,2}),([0-9]|[1-9][0-9]{1,2})"
                  r"(\n([0-9]|[1-9][0-9]{1,2}),([0-9]|[1-9][0-9]{1,2}),([0-9]|[1-9][0-9]{1,2})){1,3}")),
    ("sexpr_lark", "a Lisp s-expression",
     'start: s3\n'
     's3: atom | "(" s2 (" " s2)~0..2 ")"\n'
     's2: atom | "(" s1 (" " s1)~0..2 ")"\n'
     's1: atom | "(" atom (" " atom)~0..2 ")"\n'
     'atom: ATOM | NUMBER\n'
     'ATOM: /[a-z]{1,8}/\n'
     'NUMBER: /[0-9]{1,4}/\n', _check_sexpr),
    ("boolean_lark", "a boolean expression with and, or, not and parentheses",
     'start: disj\n'
     'disj: conj (" or " conj)~0..2\n'
     'conj: atom (" and " atom)~0..2\n'
     'atom: LIT | "not " LIT | "(" inner ")"\n'
     'inner: LIT (" and " LIT | " or " LIT)~0..2\n'
     'LIT: "true" | "false"\n', _check_boolean),
    ("config_lark", "a config file with two to four lines of key = value",
     'start: line line line? line?\n'
     'line: KEY " = " VALUE "\\n"\n'
     'KEY: /[a-z][a-z_]{0,11}/\n'
     'VALUE: /[0-9]{1,5}/ | /"[a-z ]{0,20}"/ | "true" | "false"\n',
     _regex_check(r'([a-z][a-z_]{0,11} = ([0-9]{1,5}|"[a-z ]{0,20}"|true|false)\n){2,4}')),
]

# --------------------------------------------------------------------------- format checks

FORMATS = jsonschema.FormatChecker()
_DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
_TIME = r"[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})"


@FORMATS.checks("date", raises=ValueError)
def _is_date(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not re.fullmatch(_DATE, value, re.ASCII):
        raise ValueError("not YYYY-MM-DD")
    datetime.date.fromisoformat(value)
    return True


@FORMATS.checks("time", raises=ValueError)
def _is_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not re.fullmatch(_TIME, value, re.ASCII):
        raise ValueError("not an RFC 3339 full-time (HH:MM:SS[.frac](Z|+HH:MM))")
    hours, minutes, seconds = int(value[:2]), int(value[3:5]), int(value[6:8])
    if hours > 23 or minutes > 59 or seconds > 60:  # RFC 3339 allows a leap second
        raise ValueError("hour, minute or second out of range")
    return True


@FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    date, sep, time_ = value[:10], value[10:11], value[11:]
    if sep not in ("T", "t"):
        raise ValueError("no 'T' between date and time")
    return _is_date(date) and _is_time(time_)


@FORMATS.checks("uuid", raises=ValueError)
def _is_uuid(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not re.fullmatch(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}", value):
        raise ValueError("not 8-4-4-4-12 hex digits")
    uuid.UUID(value)
    return True


@FORMATS.checks("ipv4", raises=ValueError)
def _is_ipv4(value: object) -> bool:
    return not isinstance(value, str) or bool(ipaddress.IPv4Address(value))


@FORMATS.checks("ipv6", raises=ValueError)
def _is_ipv6(value: object) -> bool:
    return not isinstance(value, str) or bool(ipaddress.IPv6Address(value))


@FORMATS.checks("email", raises=ValueError)
def _is_email(value: object) -> bool:
    if isinstance(value, str) and not re.fullmatch(r"[^@\s]+@[^@\s]+", value):
        raise ValueError("not local@domain")
    return True


@FORMATS.checks("hostname", raises=ValueError)
def _is_hostname(value: object) -> bool:
    label = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    if isinstance(value, str) and (len(value) > 253 or not re.fullmatch(rf"{label}(\.{label})*", value)):
        raise ValueError("not an RFC 1123 hostname")
    return True


@FORMATS.checks("uri", raises=ValueError)
def _is_uri(value: object) -> bool:
    if isinstance(value, str) and not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*:[^\s\"<>\\^`{|}]*", value):
        raise ValueError("not an absolute URI (scheme:rest, no spaces)")
    return True


@FORMATS.checks("duration", raises=ValueError)
def _is_duration(value: object) -> bool:
    pattern = r"P(([0-9]+Y)?([0-9]+M)?([0-9]+D)?(T([0-9]+H)?([0-9]+M)?([0-9]+(\.[0-9]+)?S)?)?|[0-9]+W)"
    if isinstance(value, str) and (not re.fullmatch(pattern, value) or value in ("P", "PT") or value.endswith("T")):
        raise ValueError("not an ISO 8601 duration")
    return True


# --------------------------------------------------------------------------- cases and checks


@dataclass(frozen=True)
class Case:
    """One constraint of the corpus: its kind, name, chat prompt, the constraint and its check."""

    kind: str  # json | regex | choice | grammar
    name: str
    prompt: str
    constraint: dict  # the keyword of StructuredOutputsParams
    checker: Callable[[str], None] = field(compare=False, repr=False)


def _json_checker(schema: dict) -> Callable[[str], None]:
    """Numbers are read as ``Decimal`` on both sides, so ``multipleOf: 0.01`` and bounds are
    exact (floats would reject 0.29 as a multiple of 0.01, and round 0.99999999999999999 to 1)."""
    exact = json.loads(json.dumps(schema), parse_float=Decimal)
    validator = jsonschema.Draft202012Validator(exact, format_checker=FORMATS)

    def check(text: str) -> None:
        value = json.loads(text, parse_float=Decimal)  # ValueError on malformed JSON
        errors = sorted(validator.iter_errors(value), key=lambda e: list(e.path))
        if errors:
            raise ValueError("; ".join(f"{'/'.join(map(str, e.path)) or '(root)'}: {e.message}" for e in errors[:3]))

    return check


def _choice_checker(choices: list[str]) -> Callable[[str], None]:
    def check(text: str) -> None:
        if text not in choices:
            raise ValueError(f"not one of {choices}")

    return check


def cases() -> list[Case]:
    """Every constraint of the corpus, in a fixed order."""
    out = [Case("json", name, f"Reply with JSON only: {what}.", {"json": schema}, _json_checker(schema))
           for name, what, schema in SCHEMAS]
    out += [Case("regex", name, f"Reply with {what} only.", {"regex": pattern}, _regex_check(pattern))
            for name, what, pattern in REGEXES]
    out += [Case("choice", name, f"Answer with one word or phrase: {what}.", {"choice": choices}, _choice_checker(choices))
            for name, what, choices in CHOICES]
    out += [Case("grammar", name, f"Write {what}.", {"grammar": text}, checker) for name, what, text, checker in GRAMMARS]
    return out


def check(case: Case, text: str) -> str | None:
    """None if ``text`` satisfies ``case``; otherwise why not."""
    try:
        case.checker(text)
    except (ValueError, jsonschema.exceptions.FormatError) as error:
        return f"{type(error).__name__}: {error}"[:300]
    return None


#: sampling variants, cycled per request: (temperature, top_p, n); a seed per request when temperature > 0
SAMPLING = [(0.0, 1.0, 1), (0.8, 1.0, 2), (1.0, 1.0, 3), (0.7, 0.9, 1), (0.9, 0.95, 2), (1.0, 1.0, 1)]
REQUESTS_PER_KIND = {"json": 6, "regex": 6, "choice": 4, "grammar": 4}


def requests(corpus: list[Case], per_kind: dict[str, int], max_tokens: int) -> list[tuple[Case, Any]]:
    """``(case, SamplingParams)`` pairs: ``per_kind[case.kind]`` requests per case, cycling :data:`SAMPLING`."""
    from flexpage import SamplingParams, StructuredOutputsParams

    out = []
    for index, case in enumerate(corpus):
        for r in range(per_kind[case.kind]):
            temperature, top_p, n = SAMPLING[(index + r) % len(SAMPLING)]
            out.append((case, SamplingParams(temperature=temperature, top_p=top_p, n=n, max_tokens=max_tokens,
                                             seed=1000 * index + r if temperature > 0 else None,
                                             structured_outputs=StructuredOutputsParams(**case.constraint))))
    return out


def run(llm: Any, work: list[tuple[Case, Any]], batch: int, log: Callable[[str], None] | None = None) -> list[dict]:
    """Generate ``work`` through ``llm.chat`` ``batch`` requests at a time; one record per output.

    A batch that raises (a request the engine failed) is rerun request by request, so the
    failure is charged to its own request and the others still count."""
    records = []
    for start in range(0, len(work), batch):
        chunk = work[start:start + batch]
        try:
            results = llm.chat([[{"role": "user", "content": c.prompt}] for c, _ in chunk], [p for _, p in chunk])
        except RuntimeError:
            results = []
            for case, params in chunk:
                try:
                    results += llm.chat([{"role": "user", "content": case.prompt}], params)
                except RuntimeError as error:
                    results.append(error)
        for (case, params), result in zip(chunk, results):
            base = {"kind": case.kind, "name": case.name, "temperature": params.temperature, "n": params.n,
                    "seed": params.seed}
            if isinstance(result, Exception):
                records.append({**base, "index": 0, "finish_reason": "error", "tokens": 0, "text": "",
                                "problem": f"engine error: {result}"[:300]})
                continue
            for out in result.outputs:
                problem = check(case, out.text)
                records.append({**base, "index": out.index, "finish_reason": out.finish_reason,
                                "tokens": len(out.token_ids), "text": out.text, "problem": problem})
        if log is not None:
            bad = sum(r["problem"] is not None for r in records)
            log(f"requests {start + len(chunk)}/{len(work)}: {len(records)} outputs, {bad} not valid")
    return records


def summarise(records: list[dict]) -> dict:
    """Per kind: outputs, valid, cut at max_tokens (invalid only because cut), failed."""
    per_kind: dict[str, Counter] = {}
    for r in records:
        c = per_kind.setdefault(r["kind"], Counter())
        c["outputs"] += 1
        if r["problem"] is None:
            c["valid"] += 1
        elif r["finish_reason"] == "length":
            c["cut_at_max_tokens"] += 1
        else:
            c["failed"] += 1
    total = sum(per_kind.values(), Counter())
    table = {kind: {k: c[k] for k in ("outputs", "valid", "cut_at_max_tokens", "failed")} for kind, c in per_kind.items()}
    table["all"] = {k: total[k] for k in ("outputs", "valid", "cut_at_max_tokens", "failed")}
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 constraints of each kind, one request each")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="requests per LLM.chat call")
    p.add_argument("--model", default=None, help="model folder (default: flexpage's default model)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()

    from flexpage import LLM

    corpus = cases()
    per_kind = REQUESTS_PER_KIND
    if args.quick:
        corpus = [c for kind in ("json", "regex", "choice", "grammar") for c in [c for c in corpus if c.kind == kind][:3]]
        per_kind = {kind: 1 for kind in per_kind}
    work = requests(corpus, per_kind, args.max_tokens)
    started = time.perf_counter()
    llm = LLM(args.model)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    records = run(llm, work, args.batch, log=lambda line: print(line, flush=True))
    generate_s = time.perf_counter() - started
    table = summarise(records)
    problems = [r for r in records if r["problem"] is not None]
    grammars = llm.engine.grammars
    result = {
        "constraints": dict(Counter(c.kind for c in corpus)), "requests": len(work),
        "requests_with_n_over_1": sum(params.n > 1 for _, params in work),
        "max_tokens": args.max_tokens, "model": args.model or "default (SmolLM2-135M-Instruct)",
        "load_s": load_s, "generate_s": generate_s, "output_tokens": sum(r["tokens"] for r in records),
        "grammar_cache": {"misses": grammars.misses, "hits": grammars.hits, "compile_s": grammars.compile_seconds},
        "per_kind": table,
        "cut_at_max_tokens": [r for r in problems if r["finish_reason"] == "length"],
        "failures": [r for r in problems if r["finish_reason"] != "length"],
        "finish_reasons": dict(Counter(r["finish_reason"] for r in records)),
        "examples": {c.name: next(r["text"] for r in records if r["name"] == c.name) for c in corpus},
    }
    print(f"{len(work)} requests ({result['requests_with_n_over_1']} with n > 1), {len(records)} outputs, "
          f"{result['output_tokens']} tokens in {generate_s:.0f} s; grammar cache: {grammars.misses} compiled "
          f"({grammars.compile_seconds * 1e3:.0f} ms), {grammars.hits} hits")
    for kind, row in table.items():
        print(f"{kind:>8}: {row['valid']}/{row['outputs']} valid, {row['cut_at_max_tokens']} cut at max_tokens, "
              f"{row['failed']} failed")
    for r in problems:
        print(f"  {r['finish_reason']:>6} {r['kind']}/{r['name']} (t={r['temperature']}, seed {r['seed']}, "
              f"#{r['index']}, {r['tokens']} tokens): {r['problem']}\n         {r['text'][:160]!r}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
