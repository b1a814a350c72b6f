"""The compact Llama-family forward (``model_impl="flexpage"``) and its pre-packed linears.

* ``CompactDecoder`` computes what HF's own modules compute: the same logits for every
  position of a prompt (fp32: to rounding; bf16: the same greedy tokens), for Llama,
  Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k norms).
* ``PackedLinear`` is bit-identical to ``F.linear``, packed or not.
* The engine takes the compact path where it exists ("auto"), HF's modules otherwise or
  on request, and names a wrong ``model_impl``. (Greedy equality with HF generate through
  the engine on both paths: tests/test_engine.py.)
"""

from __future__ import annotations

import gc
import pathlib

import pytest
import torch
import torch.nn.functional as F

from engine_models import load_reference, random_prompts
from flexpage.config import EngineConfig
from flexpage.model.compact import CompactDecoder, supports
from flexpage.model.packed_linear import PackedLinear, can_prepack, padded_rows, row_step

pytestmark = pytest.mark.usefixtures("single_torch_thread")

LLAMA_FAMILY = ["llama", "mistral", "qwen2", "qwen3"]
PROMPT = random_prompts([40], seed=3)[0]


def dense_attend(scale: float):
    """Causal attention over one whole prompt (no paging): the compact forward's ``attend``."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)

    return attend


def compact_logits(model: torch.nn.Module, prompt: list[int], *, prepack: bool = True) -> torch.Tensor:
    decoder = CompactDecoder(model, prepack=prepack)
    ids = torch.tensor(prompt)
    return decoder.forward(ids, torch.arange(len(prompt)), torch.arange(len(prompt)), dense_attend(decoder.scale))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_compact_forward_gives_hf_logits_in_float32(kind, tiny_model):
    """Every position's logits; Mistral's window is longer than nothing here, so it is covered in the engine tests."""
    model = load_reference(tiny_model(kind))
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT])).logits[0]
    got = compact_logits(model, PROMPT)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_compact_forward_in_bfloat16_gives_hf_greedy_tokens(kind, tiny_model):
    """bf16 with packed weights (where oneDNN runs bf16): the same argmax at every position and
    logits within bf16 rounding of HF's own bf16 forward."""
    model = load_reference(tiny_model(kind)).to(torch.bfloat16)
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT])).logits[0].float()
    got = compact_logits(model, PROMPT).float()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.95
    assert (got - expected).norm() / expected.norm() < 2e-2


def test_tied_lm_head_keeps_the_embedding_and_gives_hf_logits():
    """SmolLM2 ties its LM head to the embedding: the packed head is a copy, the lookup table stays."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = [int(t) for t in torch.randint(0, 128, (24,))]
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].float()
    got = compact_logits(model, prompt).float()
    assert not model.model.embed_tokens.weight.is_meta
    assert (got - expected).norm() / expected.norm() < 2e-2


def test_packed_decoder_releases_the_hf_weights_it_took(tiny_model):
    model = load_reference(tiny_model("llama"))  # float32: packed wherever oneDNN is built in
    decoder = CompactDecoder(model)
    attn = model.model.layers[0].self_attn
    if not decoder.layers[0].qkv.packed:
        pytest.skip("this torch has no oneDNN: nothing is packed")
    assert attn.q_proj.weight.is_meta and attn.v_proj.weight.is_meta and model.model.layers[0].mlp.down_proj.weight.is_meta
    assert model.lm_head.weight.is_meta  # untied in the tiny configs: packed like the projections
    assert not model.model.embed_tokens.weight.is_meta  # still read by the embedding lookup


def test_a_packed_decoder_lets_go_of_the_memory_mapped_checkpoint(tiny_model):
    """transformers maps a checkpoint of the model's dtype into memory and its weights are views
    of that mapping: once the projections are packed, the weights kept as they are (embedding,
    norms) get memory of their own, so the whole file does not stay mapped (and resident)."""
    folder = tiny_model("llama")
    model = load_reference(folder)
    checkpoint = str(next(folder.glob("*.safetensors")).resolve())

    def mapped() -> bool:
        return checkpoint in pathlib.Path("/proc/self/maps").read_text()

    if not mapped():
        pytest.skip("transformers did not memory-map this checkpoint")
    embedding = model.model.embed_tokens.weight.clone()
    decoder = CompactDecoder(model)
    if not decoder.lm_head.packed:
        pytest.skip("this torch has no oneDNN: nothing is packed")
    gc.collect()
    assert not mapped()
    assert torch.equal(decoder.embed, embedding)


def test_unpacked_decoder_shares_the_hf_weights():
    """Without packing, the HF projections become views of the fused weight, nothing is copied twice."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    decoder = CompactDecoder(model, prepack=False)
    attn = model.model.layers[0].self_attn
    assert not decoder.layers[0].qkv.packed
    assert attn.k_proj.weight.untyped_storage().data_ptr() == decoder.layers[0].qkv.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_matches_f_linear(dtype, rows):
    """Exact where the same kernel must run, within the dtype's rounding where oneDNN/MKL may
    pick another kernel (e.g. for another input layout, on another CPU)."""
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 48, dtype=dtype), torch.randn(96, dtype=dtype)
    x = torch.randn(rows, 48, dtype=dtype)
    x_strided = x.t().contiguous().t()
    linear = PackedLinear(weight, bias)
    assert linear.packed == can_prepack(weight)
    reference = F.linear(x.double(), weight.double(), bias.double())
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for out in (linear(x), linear(x_strided)):
        torch.testing.assert_close(out.double(), reference, rtol=tolerance, atol=tolerance * reference.abs().max().item())
    if linear.packed:  # the input is made contiguous first: the same packed kernel on the same data
        assert torch.equal(linear(x_strided), linear(x))
    else:  # PackedLinear is F.linear itself
        assert torch.equal(linear(x), F.linear(x, weight, bias))
        assert torch.equal(linear(x_strided), F.linear(x_strided, weight, bias))


@pytest.mark.parametrize(("row_step", "num_buckets"), [(16, 24), (8, 28), (2, 36)])
def test_packed_rows_come_in_few_buckets(row_step: int, num_buckets: int):
    """oneDNN builds (and keeps) a kernel per input shape: every row count a step can have maps
    to one of a few buckets up to 2048, never fewer rows, whole row steps (16: AMX tiles), at
    most a row step less one extra up to 8 steps, at most 25% above (2: float32)."""
    buckets = {padded_rows(rows, row_step) for rows in range(1, 2049)}
    assert len(buckets) == num_buckets and max(buckets) == 2048
    for rows in range(1, 2049):
        padded = padded_rows(rows, row_step)
        assert padded >= rows and padded % row_step == 0
        assert padded - rows <= (row_step - 1 if rows <= 8 * row_step else rows // 4), rows


def test_float32_weights_are_packed_wherever_onednn_is_built_in():
    """oneDNN's packed float32 linear beat MKL's ``F.linear`` at decode-sized batches (0.42x at 2-8
    rows on the AVX2 test CPU): float32 is packed too, its rows padded to a multiple of 2."""
    linear = PackedLinear(torch.randn(96, 48))
    assert linear.packed == torch.backends.mkldnn.is_available()
    assert (linear.row_step, row_step(torch.float32)) == (2, 2)
    assert row_step(torch.bfloat16) in (8, 16)


def test_a_packed_linear_pads_rows_without_changing_them():
    """A padded row is computed as if alone: same values as the unpadded bucket-sized call."""
    weight = torch.randn(96, 48, dtype=torch.bfloat16)
    linear = PackedLinear(weight)
    x = torch.randn(16, 48, dtype=torch.bfloat16)
    assert linear(x[:5]).shape == (5, 96)
    if linear.packed:
        assert torch.equal(linear(x[:5]), linear(torch.cat([x[:5], x.new_zeros(11, 48)]))[:5])


@pytest.mark.parametrize(("kind", "expected"), [(k, True) for k in LLAMA_FAMILY] + [("gemma2", False), ("bloom", False)])
def test_supports_the_llama_family_only(kind, expected, tiny_model):
    assert supports(load_reference(tiny_model(kind))) is expected


@pytest.mark.parametrize(("kind", "impl", "compact"), [("llama", "auto", True), ("llama", "transformers", False),
                                                       ("gemma2", "auto", False)])
def test_engine_picks_the_model_impl(kind, impl, compact, tiny_model, llm_factory):
    llm = llm_factory(tiny_model(kind), model_impl=impl)
    assert (llm.engine.runner.compact is not None) is compact


def test_model_impl_flexpage_without_a_compact_forward_is_a_value_error(tiny_model, llm_factory):
    with pytest.raises(ValueError, match="model_impl: 'flexpage' has no compact forward for model_type='gemma2'"):
        llm_factory(tiny_model("gemma2"), model_impl="flexpage")


def test_unknown_model_impl_is_a_value_error():
    with pytest.raises(ValueError, match="model_impl: got 'vllm', expected one of"):
        EngineConfig(model_impl="vllm")


def rotary_values(model: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's rotary module at ``positions`` in one call, as rope_tables lays them out."""
    cos, sin = model.model.rotary_emb(model.model.norm.weight, positions[None])
    half = cos.shape[-1] // 2
    return cos[0, :, None], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_give_hf_rotary_values_at_any_positions(dtype, tiny_model):
    """Static RoPE: rows of a table the decoder computes once (and grows past its largest
    position), equal to HF's module called at those positions (up to the last bit of float32's
    cos and sin: ATen computes a tensor's tail elements with the scalar functions)."""
    model = load_reference(tiny_model("llama")).to(dtype)
    decoder = CompactDecoder(model, prepack=False)
    for positions in (torch.tensor([5, 0]), torch.arange(37), torch.tensor([300, 2, 129, 300])):
        got, want = decoder.rope_tables(positions), rotary_values(model, positions)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype == dtype and a.is_contiguous()
            torch.testing.assert_close(a, b, rtol=0, atol=2e-7 if dtype == torch.float32 else 8e-3)


def test_dynamic_rope_tables_come_from_hf_rotary_module_at_every_step():
    """Dynamic NTK RoPE changes its frequencies with the longest position seen: no table, the module's own values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         num_hidden_layers=1, vocab_size=128, max_position_embeddings=64,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = LlamaForCausalLM(config).eval()
    decoder = CompactDecoder(model, prepack=False)
    for positions in (torch.arange(8), torch.tensor([200, 3])):
        for a, b in zip(decoder.rope_tables(positions), rotary_values(model, positions)):
            assert torch.equal(a, b)
