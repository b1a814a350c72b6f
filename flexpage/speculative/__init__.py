"""Speculative decoding's building blocks: propose tokens cheaply, verify them in one step.

* :mod:`~flexpage.speculative.config` -- :class:`SpeculativeConfig`, vLLM's ``speculative_config`` dict;
* :mod:`~flexpage.speculative.tree` -- :class:`DraftTree`, proposals as a tree rooted at the
  sequence's last token, and the tables of the tree-attention recipe
  (``recipes/tree_verification.py``);
* :mod:`~flexpage.speculative.ngram` -- prompt lookup (vLLM's ``ngram`` method), several
  matches as several branches;
* :mod:`~flexpage.speculative.draft_model` -- a draft model (vLLM's ``draft_model`` method)
  on its own runner and KV pool;
* :mod:`~flexpage.speculative.rejection` -- verification: greedy, and rejection sampling that
  keeps the target's distribution, for chains (batched) and trees.

The engine's side (proposals as extra query rows, KV rollback, the executor's verification
step) is described in docs/speculative.md.
"""

from flexpage.speculative.config import SpeculativeConfig
from flexpage.speculative.tree import DraftTree

__all__ = ["DraftTree", "SpeculativeConfig"]
