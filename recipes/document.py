"""Document masking: several documents packed into one sequence attend only within their
own document (causally).

Used for packed pre-training and batched retrieval, e.g. Krell et al., "Efficient
Sequence Packing without Cross-contamination", 2021, https://arxiv.org/abs/2107.02027.
"""

from torch import Tensor

from flexpage.attention.recipe import Recipe, causal_mask, causal_rule


def document_mask(document_ids: Tensor) -> Recipe:
    """``document_ids``: [num_seqs, max_len] int tensor, the document of each logical position."""
    document_ids = document_ids.int()

    def same_document(b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return causal_mask(b, h, q_pos, kv_pos) & (document_ids[b, q_pos] == document_ids[b, kv_pos])

    # page level: no cheap bound on documents, so only causality prunes pages
    def rule(b: Tensor, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
        may, _ = causal_rule(b, q_lo, q_hi, kv_lo, kv_hi)
        return may, may & False

    return Recipe("document_mask", mask_mod=same_document, block_rule=rule)
