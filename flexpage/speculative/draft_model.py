"""Draft-model proposals: a small model of the same vocabulary guesses the next k tokens.

Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", 2023, as
vLLM's ``draft_model`` method: ``{"method": "draft_model", "model": PATH,
"num_speculative_tokens": k}``. The draft runs in the engine's process on its own
:class:`~flexpage.model.runner.ModelRunner` (the same paged attention and compiled step as the
target) with **its own small KV pool**, so its cache never competes with the target's blocks.

Per step, for the sequences the :class:`~flexpage.speculative.speculator.Speculator` lets
propose, batched over them:

1. **catch up**: the tokens the draft has not seen (the prompt on the first call; after that
   the target's accepted tokens and its own next token) run as one chunk per sequence, whose
   last row gives the first proposal;
2. **k - 1 decode steps**, one row per sequence, each feeding the previous proposal.

Proposals are the draft's argmax (as vLLM's v1 draft proposers): verification then treats them
as point masses, which keeps every emitted token distributed as the target's at any
temperature (:func:`~flexpage.speculative.rejection.rejection_sample_chain`); a sampling
draft would raise acceptance at temperature > 0 but not change what is emitted.

**KV bookkeeping** needs no rollback call: the proposer remembers which tokens' K/V each
sequence holds in the draft pool (``fed``). Whatever the target accepted, the sequence's tokens
agree with ``fed`` up to its last position (accepted proposals, then the target's own token),
so the next call rewrites the draft's K/V from there: rejected proposals' slots are
overwritten. Draft blocks are one attention block each (the draft's page is the target's
attention block), handed out from a free list (page 0 is the pool's null page); a sequence
gone from the running batch gives them back (:meth:`DraftModelProposer.release`). When the
pool runs short, sequences not proposing this step give up theirs; a sequence that would not
fit even then proposes nothing and evicts nobody. A forward that fails forgets the state of
every sequence it ran for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from flexpage.core.scheduler_output import StepInputs
from flexpage.model.loader import load_hf_model, resolve_model_path
from flexpage.model.runner import ModelRunner

__all__ = ["DraftModelProposer", "save_layer_draft"]


@dataclass(slots=True)
class _DraftSequence:
    fed: list[int] = field(default_factory=list)  # tokens whose K/V the draft pool holds, in order
    blocks: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy chains from a draft model, batched over the proposing sequences (module docstring)."""

    def __init__(self, model: str, *, dtype: torch.dtype, vocab_size: int, block_size: int, num_blocks: int,
                 compile: bool = True, compile_step: bool = True) -> None:
        """``model``: the draft's path (anything ``LLM(model=...)`` takes); ``vocab_size``: the
        target's, which the draft must share; ``block_size``: tokens per draft block (one
        attention block); ``num_blocks``: the draft pool's size."""
        draft = load_hf_model(resolve_model_path(model), dtype)
        draft_vocab = draft.config.get_text_config().vocab_size
        if draft_vocab != vocab_size:
            raise ValueError(f"speculative_config: the draft model {model!r} has a vocabulary of {draft_vocab} "
                             f"tokens, the target's has {vocab_size}; a draft must share the target's tokenizer")
        self.block_size = block_size
        self.vocab_size = vocab_size
        # page 0 is the pool's null page, never handed out
        self.runner = ModelRunner(draft, num_blocks=num_blocks + 1, block_size=block_size, compile=compile,
                                  compile_step=compile_step)
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks, 0, -1))
        self._sequences: dict[int, _DraftSequence] = {}

    def propose_chains(self, wanted: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """Per ``(seq_id, token_ids, k)``, up to ``k`` proposed tokens after ``token_ids``
        (empty where the draft pool cannot hold the sequence)."""
        chains: list[list[int]] = [[] for _ in wanted]
        busy = {seq_id for seq_id, _, _ in wanted}
        rows = []  # (index into wanted, state, first uncomputed position)
        for i, (seq_id, token_ids, k) in enumerate(wanted):
            state = self._sequences.setdefault(seq_id, _DraftSequence())
            # fed is the tokens before the last call's proposals plus all but the last of them;
            # the target kept some proposals and then chose its own token, so everything fed
            # before the sequence's last position still matches and the rest is stale
            start = min(len(state.fed), len(token_ids) - 1)
            del state.fed[start:]
            if self._reserve(state, len(token_ids) + k - 1, busy):
                rows.append((i, state, start))
        if not rows:
            return chains
        try:
            return self._run(wanted, rows, chains)
        except BaseException:
            for seq_id, _, _ in wanted:  # what the failed forward wrote is unknown: start these over
                self.release(seq_id)
            raise

    def _run(self, wanted: Sequence[tuple[int, Sequence[int], int]], rows: list[tuple[int, _DraftSequence, int]],
             chains: list[list[int]]) -> list[list[int]]:
        # 1. catch up: every unseen token, the last row's argmax is the first proposal
        inputs = StepInputs([], [], [], [], [])
        for i, state, start in rows:
            token_ids = wanted[i][1]
            inputs.token_ids.extend(token_ids[start:])
            inputs.block_tables.append(state.blocks)
            inputs.seq_lens.append(len(token_ids))
            inputs.query_lens.append(len(token_ids) - start)
            inputs.sample_rows.append(len(inputs.token_ids) - 1)
        last = self._argmax(inputs)
        for (i, state, start), token in zip(rows, last):
            state.fed.extend(wanted[i][1][start:])
            chains[i].append(token)
        # 2. one decode row per sequence still short of its k
        while True:
            going = [(i, state) for i, state, _ in rows if len(chains[i]) < wanted[i][2]]
            if not going:
                return chains
            inputs = StepInputs([], [], [], [], [])
            for row, (i, state) in enumerate(going):
                inputs.token_ids.append(chains[i][-1])
                inputs.block_tables.append(state.blocks)
                inputs.seq_lens.append(len(state.fed) + 1)
                inputs.query_lens.append(1)
                inputs.sample_rows.append(row)
            for (i, state), token in zip(going, self._argmax(inputs)):
                state.fed.append(chains[i][-1])
                chains[i].append(token)

    def warm_up(self) -> None:
        """Build the draft's kernels and programs: a catch-up step of two sequences (a prefill
        chunk beside a decode row), then decode steps."""
        prompts = [[(10 + j) % self.vocab_size for j in range(40)], [(60 + j) % self.vocab_size for j in range(5)]]
        self.propose_chains([(-1, prompts[0], 3), (-2, prompts[1], 3)])
        self.propose_chains([(-1, [*prompts[0], 7], 2), (-2, [*prompts[1], *range(20, 30)], 2)])
        self.release(-1)
        self.release(-2)

    def _argmax(self, inputs: StepInputs) -> list[int]:
        return self.runner.execute(inputs).argmax(dim=-1).tolist()

    def _reserve(self, state: _DraftSequence, num_tokens: int, busy: set[int]) -> bool:
        """Blocks for ``num_tokens`` positions of ``state``, taking them from sequences not in
        ``busy`` when the free list runs short; False (and ``state`` emptied) if they do not fit."""
        needed = -(-num_tokens // self.block_size) - len(state.blocks)
        idle = [seq_id for seq_id in self._sequences if seq_id not in busy]
        if needed > len(self._free) + sum(len(self._sequences[seq_id].blocks) for seq_id in idle):
            # cannot fit even with every idle sequence's blocks: evict nobody, give back its own
            self._free.extend(reversed(state.blocks))
            state.blocks.clear()
            state.fed.clear()
            return False
        while needed > len(self._free):
            self.release(idle.pop(0))
        for _ in range(max(0, needed)):
            state.blocks.append(self._free.pop())
        return True

    def release(self, seq_id: int) -> None:
        """Forget a sequence that left the running batch; its draft blocks go back to the pool."""
        state = self._sequences.pop(seq_id, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)


def save_layer_draft(target: str | None, num_layers: int, folder: str) -> str:
    """Write a draft made of ``target``'s first ``num_layers`` decoder layers, its final norm and
    its LM head (no training) as an HF folder with the target's tokenizer; returns the folder.

    The one draft every model has: it shares the tokenizer and the embeddings by construction,
    and costs ``num_layers`` layers plus the LM head per proposed token. Without training
    (layer-skipping drafts such as LayerSkip or Draft & Verify train or search for it), its
    acceptance is low: measure it (``python -m bench.speculative --draft-layers N``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from flexpage.model.loader import load_tokenizer

    path = resolve_model_path(target)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    layers = config.get_text_config().num_hidden_layers
    if not 1 <= num_layers < layers:
        raise ValueError(f"num_layers: got {num_layers}, expected 1 to {layers - 1} (the target has {layers})")
    cut = {"num_hidden_layers": num_layers}
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer kinds (sliding/full) keep their order
        cut["layer_types"] = config.layer_types[:num_layers]
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                 dtype=getattr(config, "torch_dtype", None) or torch.float32, **cut)
    model.save_pretrained(folder)
    load_tokenizer(path).save_pretrained(folder)
    return folder
