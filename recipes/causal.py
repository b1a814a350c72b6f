"""Causal attention: each token sees itself and every earlier token (the default).

Vaswani et al., "Attention Is All You Need", 2017, https://arxiv.org/abs/1706.03762
"""

from flexpage.attention.recipe import CAUSAL, Recipe


def causal() -> Recipe:
    return CAUSAL
