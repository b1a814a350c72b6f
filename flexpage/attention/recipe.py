"""Attention variants as logical programs.

A :class:`Recipe` is what a user writes: a ``mask_mod`` and/or ``score_mod`` over
*logical* positions (``q_pos``/``kv_pos`` are token positions within the sequence, ``b``
is the sequence's index in the batch, ``h`` the query head), plus a ``block_rule`` that
states the same mask at page granularity so the paging layer can skip invisible pages and
mark wholly visible ones (which then run without evaluating the mask at all).

The paging layer (:mod:`flexpage.attention.paging`) translates physical pool slots to
logical positions before calling a recipe; a recipe never sees a page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class BlockRule(Protocol):
    """Page-level form of a mask: which (query range, key range) pairs may or must be visible.

    Arguments are integer tensors that broadcast together: ``b`` the sequence index,
    ``q_lo``/``q_hi`` the first/last logical query position of a query block and
    ``kv_lo``/``kv_hi`` the first/last logical key position of a page (inclusive).
    Returns ``(may_see, sees_all)``: some pair may be visible / every pair is visible.
    A rule must never answer ``may_see=False`` for a visible pair or ``sees_all=True``
    for an invisible one; it may be conservative the other way (costing speed only).
    """

    def __call__(self, b: Tensor, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]: ...


def causal_rule(b: Tensor, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
    return kv_lo <= q_hi, kv_hi <= q_lo


def unknown_rule(b: Tensor, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
    """No page-level knowledge: every page may be visible, none surely is (always correct)."""
    may = (kv_lo >= 0) | (q_lo >= 0)
    return may, ~may


def window_rule(window: int) -> BlockRule:
    """``0 <= q_pos - kv_pos < window`` at page granularity."""

    def rule(b: Tensor, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
        may = (kv_lo <= q_hi) & (kv_hi > q_lo - window)
        every = (kv_hi <= q_lo) & (kv_lo > q_hi - window)
        return may, every

    return rule


def and_rules(*rules: BlockRule) -> BlockRule:
    def rule(b: Tensor, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
        may, every = rules[0](b, q_lo, q_hi, kv_lo, kv_hi)
        for other in rules[1:]:
            m, e = other(b, q_lo, q_hi, kv_lo, kv_hi)
            may, every = may & m, every & e
        return may, every

    return rule


def or_rules(*rules: BlockRule) -> BlockRule:
    def rule(b: Tensor, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
        may, every = rules[0](b, q_lo, q_hi, kv_lo, kv_hi)
        for other in rules[1:]:
            m, e = other(b, q_lo, q_hi, kv_lo, kv_hi)
            may, every = may | m, every | e
        return may, every

    return rule


def causal_mask(b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
    return q_pos >= kv_pos


@dataclass(frozen=True)
class Recipe:
    """A named attention variant in logical positions.

    ``mask_mod=None`` means no mask at all (bidirectional); most recipes include the
    causal mask explicitly. ``block_rule`` must describe ``mask_mod`` (see :class:`BlockRule`);
    left out, it is :func:`causal_rule` for the causal mask and otherwise
    :func:`unknown_rule`, which is always correct but visits every page of a sequence.

    ``window`` declares what the engine may do with memory: a query at ``q_pos`` never sees a
    key before ``q_pos - window + 1``, and neither does any later query, so the block manager
    gives back the blocks that fall behind (sliding window, chunked local attention). A
    recipe that may look arbitrarily far back leaves it ``None``.

    Recipes are compared and hashed by their fields, functions by identity: compiled kernels
    and batch plans are cached per recipe object, so two instances of a parameterised recipe
    (closing over different tensors or numbers) never share them, whatever their names.
    """

    name: str
    mask_mod: MaskMod | None = causal_mask
    score_mod: ScoreMod | None = None
    block_rule: BlockRule | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or isinstance(self.window, bool)
                                        or self.window < 1):
            raise ValueError(f"window: got {self.window!r}, expected None or an int >= 1")
        if self.block_rule is None:
            rule = causal_rule if self.mask_mod is causal_mask else unknown_rule
            object.__setattr__(self, "block_rule", rule)


def and_masks(*mods: MaskMod) -> MaskMod:
    def mask(b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        out = mods[0](b, h, q_pos, kv_pos)
        for mod in mods[1:]:
            out = out & mod(b, h, q_pos, kv_pos)
        return out

    return mask


def or_masks(*mods: MaskMod) -> MaskMod:
    def mask(b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        out = mods[0](b, h, q_pos, kv_pos)
        for mod in mods[1:]:
            out = out | mod(b, h, q_pos, kv_pos)
        return out

    return mask


def chain_scores(*mods: ScoreMod) -> ScoreMod:
    def score(s: Tensor, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        for mod in mods:
            s = mod(s, b, h, q_pos, kv_pos)
        return s

    return score


def compose(*recipes: Recipe, name: str | None = None) -> Recipe:
    """All constraints of several recipes at once: masks AND-ed, score mods applied in order."""
    masks = [r.mask_mod for r in recipes if r.mask_mod is not None]
    scores = [r.score_mod for r in recipes if r.score_mod is not None]
    rules = [r.block_rule for r in recipes if r.mask_mod is not None]
    windows = [r.window for r in recipes if r.window is not None]  # AND-ed masks: the narrowest bound holds
    return Recipe(
        name=name or "+".join(r.name for r in recipes),
        mask_mod=and_masks(*masks) if masks else None,
        score_mod=chain_scores(*scores) if scores else None,
        block_rule=and_rules(*rules) if rules else unknown_rule,
        window=min(windows) if windows else None,
    )


CAUSAL = Recipe("causal")


def offset_heads(recipe: Recipe, offset: int) -> Recipe:
    """``recipe`` for a shard of the heads starting at head ``offset`` (tensor parallelism): its
    mods see the model's head numbers (``h + offset``), so per-head parameters such as ALiBi's
    slopes follow their heads to the rank that holds them. ``offset`` 0: ``recipe`` itself."""
    if offset == 0:
        return recipe
    mask, score = recipe.mask_mod, recipe.score_mod
    shifted_mask = mask if mask is None or mask is causal_mask else (
        lambda b, h, q_pos, kv_pos: mask(b, h + offset, q_pos, kv_pos))
    shifted_score = score if score is None else (
        lambda s, b, h, q_pos, kv_pos: score(s, b, h + offset, q_pos, kv_pos))
    return Recipe(recipe.name, mask_mod=shifted_mask, score_mod=shifted_score, block_rule=recipe.block_rule,
                  window=recipe.window)
