"""Structured outputs: constrain what a request generates to a JSON schema, regex, choice or grammar.

* :mod:`~flexpage.structured.params` -- :class:`StructuredOutputsParams`, what a request asks for;
* :mod:`~flexpage.structured.backend` -- the seam to a grammar library;
* :mod:`~flexpage.structured.llguidance_backend` -- the library used (llguidance);
* :mod:`~flexpage.structured.compiler` -- compiled grammars cached by constraint;
* :mod:`~flexpage.structured.bitmask` -- allowed-token bitmasks applied to logits.

The engine keeps one matcher per sample (``Request.grammars``); the executor fills and
applies the masks of a step's rows; the output processor advances each matcher by the token
its sample accepted and ends the output when the grammar is complete.
"""

from flexpage.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
