"""Shared pytest fixtures for the flexpage test suite."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> pathlib.Path:
    """Folder of the converted default model (SmolLM2-135M-Instruct).

    Converting the packaged GGUF takes ~30 s, so it happens at most once per
    session (and once per machine: the result lives in the flexpage cache,
    ``$FLEXPAGE_CACHE`` or ``~/.cache/flexpage/models``).
    """
    from flexpage.model.loader import resolve_model_path

    return resolve_model_path(None)
