"""``call_compiled``: the shared compiled attention functions outgrow Dynamo's default of 8
variants per code object (under ``fullgraph=True`` a hard failure); the limit is raised
for the call that compiles a new variant, and only there."""

from __future__ import annotations

import torch

from flexpage.attention.flex import call_compiled


def test_more_variants_than_dynamos_default_limit_compile_and_the_limit_stays_put():
    def scale(x: torch.Tensor, factor: int) -> torch.Tensor:
        return x * factor

    compiled = torch.compile(scale, fullgraph=True, dynamic=False)  # each factor is its own variant
    limit = torch._dynamo.config.recompile_limit
    x = torch.ones(3)
    for factor in range(limit + 4):
        assert call_compiled(compiled, x, factor).tolist() == [factor] * 3
    assert torch._dynamo.config.recompile_limit == limit
    for factor in range(limit + 4):  # every variant is cached: no new compile, no failure
        assert call_compiled(compiled, x, factor)[0] == factor
