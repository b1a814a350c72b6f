"""Compiled grammars, cached by constraint: a server sees the same schema again and again.

:class:`GrammarCompiler` is thread-safe: the server compiles a request's constraint in its
tokenizer threads (off the engine's step loop, and before the request is queued, so a bad
schema is a 400 with no token generated); ``LLMEngine.add_request`` then finds it cached.
Two threads asking for one new constraint compile it once. The backend (llguidance's view of
the tokenizer, ~0.4 s to build) is made on first use: engines that never see a constraint
never pay for it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable

import torch

from flexpage.structured.backend import Grammar, GrammarBackend, GrammarMatcher, bitmask_words
from flexpage.structured.params import StructuredOutputsParams

__all__ = ["GrammarCompiler"]


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` through one backend; keeps the last
    ``capacity`` grammars."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], capacity: int = 512) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._capacity = capacity
        self._grammars: OrderedDict[tuple[str, str], Future[Grammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.compile_seconds = 0.0

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The grammar of ``spec``, compiled now or earlier; raises what the backend raises
        (a failed compile is not cached: the next request gets the same error afresh)."""
        key = spec.key()
        backend = self.backend
        with self._lock:
            future = self._grammars.get(key)
            owner = future is None
            if owner:
                self.misses += 1
                future = self._grammars[key] = Future()
                while len(self._grammars) > self._capacity:
                    self._grammars.popitem(last=False)
            else:
                self._grammars.move_to_end(key)
                self.hits += 1
        if not owner:
            return future.result()
        start = time.perf_counter()
        try:
            grammar = backend.compile(spec)
        except BaseException as error:
            with self._lock:
                if self._grammars.get(key) is future:
                    del self._grammars[key]
            future.set_exception(error)
            raise
        self.compile_seconds += time.perf_counter() - start
        future.set_result(grammar)
        return grammar

    def bitmask(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """The allowed next tokens of each matcher, one int32 bitmask row each."""
        backend = self.backend
        bitmask = torch.empty(len(matchers), bitmask_words(backend.vocab_size), dtype=torch.int32)
        backend.fill_bitmasks(matchers, bitmask)
        return bitmask
