"""Weight-only int8 (``quantization="int8"``, :mod:`flexpage.model.int8_weights`).

* A weight quantises to int8 per output row (scale = the row's largest magnitude / 127), each
  weight within half a step, and the blocks expand to exactly the quantised weight the model is
  left holding.
* An engine with ``quantization="int8"`` computes every projection and the LM head from the
  blocks (float32: no other copy) and gives HF ``generate``'s greedy tokens for the same
  quantised model, eagerly and through the compiled step.
* What it cannot run with is refused before anything loads, naming the reason.
"""

from __future__ import annotations

import pytest
import torch

from engine_models import hf_greedy, load_reference, random_prompts
from flexpage import SamplingParams
from flexpage.model import gguf_linear
from flexpage.model.int8_weights import int8_blocks, quantize_int8

needs_kernel = pytest.mark.skipif(not gguf_linear.available(),
                                  reason="the block kernel needs an x86 CPU with AVX2/FMA/F16C and a C++ compiler")

PROMPTS = random_prompts((5, 17, 40), seed=8)
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def test_a_weight_quantises_per_output_row_within_half_a_step():
    weight = torch.randn(6, 64) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 0.0, 3.0]).unsqueeze(1)
    blocks, quantised = quantize_int8(weight)
    assert blocks.dtype == torch.uint8 and blocks.shape == (6, 2 * gguf_linear.BLOCK_BYTES["Q8_0"])
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert torch.all((quantised - weight).abs() <= step / 2 + 1e-7 * weight.abs())
    assert torch.equal(quantised[4], torch.zeros(64))  # an all-zero row stays zero
    codes = quantised / torch.where(step > 0, step, 1)
    torch.testing.assert_close(codes, codes.round(), rtol=0, atol=1e-4)  # whole multiples of the row's step
    assert codes.round().abs().max() == 127  # each row reaches its largest code
    with pytest.raises(ValueError, match="48 input features, expected a multiple of 32"):
        quantize_int8(torch.randn(4, 48))


def test_rows_quantised_a_chunk_at_a_time_give_the_same_blocks(monkeypatch):
    from flexpage.model import int8_weights

    weight = torch.randn(37, 64).bfloat16()
    whole = quantize_int8(weight)
    monkeypatch.setattr(int8_weights, "_CHUNK_WEIGHTS", 5 * 64)  # 8 chunks, the last of 2 rows
    chunked = quantize_int8(weight.clone(), in_place=True)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_blocks_expand_to_exactly_the_quantised_weight(dtype):
    blocks, quantised = quantize_int8(torch.randn(64, 96).to(dtype))
    assert quantised.dtype == dtype
    expanded = gguf_linear.block_linear(torch.eye(96), blocks).T  # float32 expansion: the unrounded values
    assert torch.equal(expanded.to(dtype), quantised)


def test_a_model_is_quantised_in_place_and_a_tied_weight_once(tiny_model):
    model = load_reference(tiny_model("llama"), tie_word_embeddings=True)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    before = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    blocks = int8_blocks(model)
    layers = model.config.num_hidden_layers
    assert len(blocks) == layers * 7 + 2 and blocks["lm_head.weight"] is blocks["model.embed_tokens.weight"]
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in blocks:
            assert torch.equal(param, quantize_int8(before[name])[1]), name
        else:  # norms
            assert torch.equal(param, before[name]), name


@needs_kernel
@pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")
@pytest.mark.parametrize("compile", [False, True])
def test_an_int8_engine_gives_hf_greedy_tokens_of_the_quantised_model(compile, tiny_model, llm_factory):
    folder = tiny_model("llama")
    llm = llm_factory(folder, quantization="int8", compile=compile, num_blocks=128)
    compact = llm.engine.runner.compact
    linears = [compact.lm_head, *(linear for layer in compact.layers
                                  for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))]
    assert all(linear.blocks is not None and linear.weight is None for linear in linears)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    reference = load_reference(folder)
    int8_blocks(reference)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize(("config", "reason"), [
    (dict(tensor_parallel_size=2), "tensor_parallel_size > 1 cannot be combined with quantization='int8'"),
    (dict(deterministic=True), "deterministic=True cannot be combined with quantization='int8'"),
    (dict(model_impl="transformers"), "quantization='int8' cannot be combined with model_impl="),
])
def test_int8_refuses_what_it_cannot_run_with(config, reason):
    from flexpage.config import EngineConfig

    with pytest.raises(ValueError, match=reason):
        EngineConfig(quantization="int8", **config)


def test_int8_refuses_a_model_without_a_compact_forward(tiny_model, llm_factory):
    with pytest.raises(ValueError, match=r"quantization: 'int8' needs the compact forward"):
        llm_factory(tiny_model("bloom"), quantization="int8")
