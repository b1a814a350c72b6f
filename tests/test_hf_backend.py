"""``attn_implementation="flexpage"`` in HF transformers gives the same model as HF's own kernels.

After ``import flexpage``, ``from_pretrained(..., attn_implementation="flexpage")`` must be a
drop-in: greedy ``generate`` returns tokens IDENTICAL to the reference implementation and
prefill logits agree tightly (fp32), for

* the default model, SmolLM2-135M (GQA 9/3), one prompt and a left-padded ragged batch, vs ``sdpa``;
* a random tiny Gemma2 with a sliding window shorter than the prompt and attention-logit
  soft-capping (q/k projections scaled x8 so the cap really bends the logits), vs ``eager``
  (sdpa refuses soft-capping);
* a random tiny Mistral (sliding window shorter than the prompt) and Qwen2, vs ``sdpa``.

Random models are built from fixed seeds; each implementation gets its own config object
(HF reads ``config._attn_implementation`` at forward time, so a shared config would make
both models run the same kernel and the comparison vacuous -- asserted below).
"""

from __future__ import annotations

import copy

import pytest
import torch

import flexpage  # noqa: F401  (registers attn_implementation="flexpage")

pytestmark = pytest.mark.usefixtures("compile_budget", "single_torch_thread")

NEW_TOKENS = 8


def test_flexpage_is_registered_with_hf():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert "flexpage" in AttentionInterface._global_mapping
    # without its own mask builder HF would hand the attention function no causal mask at all
    assert "flexpage" in AttentionMaskInterface._global_mapping


# ---- helpers ---------------------------------------------------------------------------


def build(model_cls, config, state_dict, implementation: str):
    config = copy.deepcopy(config)
    model = model_cls._from_config(config, attn_implementation=implementation, dtype=torch.float32).eval()
    model.load_state_dict(state_dict)
    assert model.config._attn_implementation == implementation
    return model


def greedy(model, input_ids, attention_mask, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy new tokens ``[B, NEW_TOKENS]`` and the logits each was chosen from ``[B, NEW_TOKENS, V]``."""
    out = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
        do_sample=False, pad_token_id=pad_token_id, return_dict_in_generate=True, output_logits=True,
    )
    return out.sequences[:, input_ids.shape[1]:], torch.stack(out.logits, dim=1)


@torch.no_grad()
def prefill_logits(model, input_ids, attention_mask) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=attention_mask).logits


def ragged_batch(lengths: list[int], vocab: int, pad: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded with ``pad``."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def assert_same_generation(reference, candidate, ids, mask, pad: int, *, atol: float = 1e-4) -> None:
    """Identical greedy tokens, and the logits at every generation step agree (fp32)."""
    want_tokens, want_logits = greedy(reference, ids, mask, pad)
    got_tokens, got_logits = greedy(candidate, ids, mask, pad)
    assert got_tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=atol)


def assert_same_model(reference, candidate, ids, mask, pad: int, *, atol: float = 1e-4) -> torch.Tensor:
    """Prefill logits at every real (non-pad) position agree, then :func:`assert_same_generation`."""
    want = prefill_logits(reference, ids, mask)
    got = prefill_logits(candidate, ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=atol)
    assert_same_generation(reference, candidate, ids, mask, pad, atol=atol)
    return want


# ---- (a) the default model, SmolLM2-135M -----------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    tokenizer.padding_side = "left"
    models = {
        impl: AutoModelForCausalLM.from_pretrained(default_model_path, attn_implementation=impl,
                                                   dtype=torch.float32).eval()
        for impl in ("sdpa", "flexpage")
    }
    assert models["flexpage"].config._attn_implementation == "flexpage"
    return tokenizer, models


SMOLLM2_ATOL = 1e-3  # 30 fp32 layers, logits of magnitude ~20
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    # > 128 tokens: more than one of the backend's 128-key blocks, so whole blocks are
    # skipped / taken without the mask, next to a short left-padded row
    "def fibonacci(n):\n    " + " ".join(f"a{i} = {i} * n + {i * i}" for i in range(12)) + "\n    return",
]


def test_smollm2_single_prompt_generates_identical_tokens(smollm2):
    tokenizer, models = smollm2
    enc = tokenizer(SMOLLM2_PROMPTS[:1], return_tensors="pt")
    assert_same_generation(models["sdpa"], models["flexpage"], enc.input_ids, enc.attention_mask,
                           tokenizer.pad_token_id, atol=SMOLLM2_ATOL)


def test_smollm2_left_padded_ragged_batch_generates_identical_tokens(smollm2):
    tokenizer, models = smollm2
    enc = tokenizer(SMOLLM2_PROMPTS, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any(), "the batch must be ragged (left padding)"
    assert enc.input_ids.shape[1] > 128
    assert_same_generation(models["sdpa"], models["flexpage"], enc.input_ids, enc.attention_mask,
                           tokenizer.pad_token_id, atol=SMOLLM2_ATOL)


# ---- (b) Gemma2: sliding window + attention-logit soft-capping, vs eager ----------------------

GEMMA2_WINDOW = 8
GEMMA2_LENGTHS = [24, 17]  # both longer than the window


def gemma2_config(softcap: float | None = 5.0, window: int = GEMMA2_WINDOW):
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=window, layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=softcap, final_logit_softcapping=None,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


@pytest.fixture(scope="module")
def gemma2_weights():
    from transformers import Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(gemma2_config())
    with torch.no_grad():  # large q/k so that soft-capping at 5.0 really changes the logits
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model.state_dict()


def test_gemma2_case_exercises_window_and_softcap(gemma2_weights):
    """The comparison is not vacuous: removing the cap or widening the window changes the logits."""
    from transformers import Gemma2ForCausalLM

    ids, mask = ragged_batch(GEMMA2_LENGTHS, 128, 0, seed=1)
    valid = mask.bool()
    base = prefill_logits(build(Gemma2ForCausalLM, gemma2_config(), gemma2_weights, "eager"), ids, mask)
    no_cap = prefill_logits(build(Gemma2ForCausalLM, gemma2_config(softcap=None), gemma2_weights, "eager"), ids, mask)
    wide = prefill_logits(build(Gemma2ForCausalLM, gemma2_config(window=256), gemma2_weights, "eager"), ids, mask)
    assert (base - no_cap)[valid].abs().max() > 0.05
    assert (base - wide)[valid].abs().max() > 0.05


def test_gemma2_window_and_softcap_match_eager_compiled(gemma2_weights):
    from transformers import Gemma2ForCausalLM

    ids, mask = ragged_batch(GEMMA2_LENGTHS, 128, 0, seed=1)
    eager = build(Gemma2ForCausalLM, gemma2_config(), gemma2_weights, "eager")
    flex = build(Gemma2ForCausalLM, gemma2_config(), gemma2_weights, "flexpage")
    assert_same_model(eager, flex, ids, mask, pad=0)


def test_gemma2_window_and_softcap_match_eager_uncompiled(gemma2_weights, monkeypatch):
    """The same program run eagerly (``FLEXPAGE_COMPILE=0``): separates recipe logic from compilation."""
    from transformers import Gemma2ForCausalLM

    monkeypatch.setenv("FLEXPAGE_COMPILE", "0")
    ids, mask = ragged_batch(GEMMA2_LENGTHS, 128, 0, seed=1)
    eager = build(Gemma2ForCausalLM, gemma2_config(), gemma2_weights, "eager")
    flex = build(Gemma2ForCausalLM, gemma2_config(), gemma2_weights, "flexpage")
    assert_same_model(eager, flex, ids, mask, pad=0)


def test_contiguous_softcap_recipe_compiles():
    """Minimal form of the Gemma2 failure: the HF backend's compiled kernel with a soft-capping recipe.

    BUG (flexpage/attention/contiguous.py, ``torch.compile(_contiguous_attention, dynamic=True)``):
    with ``dynamic=True`` Dynamo does not specialise Python floats (``specialize_float=False``),
    so the recipe's ``cap`` (a float in the score_mod closure) becomes a graph input that the
    score_mod reads back with ``.item()``; Inductor's CPU flex-attention lowering then fails
    with ``LoweringException: RuntimeError: unbacked_bindings``.
    """
    from flexpage.attention.contiguous import RowLayout, contiguous_attention
    from flexpage.recipes.softcap import softcap

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 64, generator=g)
    k = torch.randn(2, 2, 24, 64, generator=g)
    v = torch.randn(2, 2, 24, 64, generator=g)
    valid = torch.ones(2, 24, dtype=torch.bool)
    valid[1, :7] = False
    layout = RowLayout(valid, torch.tensor([0, 7]), 0, 0)
    recipe = softcap(5.0)
    want = contiguous_attention(q, k, v, layout, recipe, compile=False)
    got = contiguous_attention(q, k, v, layout, recipe, compile=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- (c) Mistral (sliding window) and Qwen2, vs sdpa -----------------------------------------


MISTRAL_WINDOW = 40


def mistral_config(window: int = MISTRAL_WINDOW):
    from transformers import MistralConfig

    return MistralConfig(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=window,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(  # SmolLM2's attention shape (9/3 heads of 64), two layers
        vocab_size=128, hidden_size=576, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def random_weights(model_cls, config, seed: int):
    torch.manual_seed(seed)
    return model_cls(config).state_dict()


def test_mistral_sliding_window_matches_sdpa():
    from transformers import MistralForCausalLM

    weights = random_weights(MistralForCausalLM, mistral_config(), seed=2)
    ids, mask = ragged_batch([150, 50], 128, 0, seed=3)  # both longer than the window; two 128-key blocks
    sdpa = build(MistralForCausalLM, mistral_config(), weights, "sdpa")
    flex = build(MistralForCausalLM, mistral_config(), weights, "flexpage")
    want = assert_same_model(sdpa, flex, ids, mask, pad=0)
    wide = prefill_logits(build(MistralForCausalLM, mistral_config(window=256), weights, "sdpa"), ids, mask)
    assert (want - wide)[mask.bool()].abs().max() > 1e-3, "the window must matter for this prompt"


def test_qwen2_matches_sdpa():
    from transformers import Qwen2ForCausalLM

    weights = random_weights(Qwen2ForCausalLM, qwen2_config(), seed=4)
    ids, mask = ragged_batch([20, 9, 15], 128, 0, seed=5)
    sdpa = build(Qwen2ForCausalLM, qwen2_config(), weights, "sdpa")
    flex = build(Qwen2ForCausalLM, qwen2_config(), weights, "flexpage")
    assert_same_model(sdpa, flex, ids, mask, pad=0)


# ---- (d) compilation is bounded by design, and a compiled model runs it --------------------


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(  # GQA 4/2, two layers: small enough to compile the whole model in a test
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


@pytest.fixture(scope="module")
def llama_pair():
    from transformers import LlamaForCausalLM

    weights = random_weights(LlamaForCausalLM, llama_config(), seed=6)
    return (build(LlamaForCausalLM, llama_config(), weights, "sdpa"),
            build(LlamaForCausalLM, llama_config(), weights, "flexpage"))


#: prompt lengths around every size the kernel's block lists change at: one and two 32-token
#: query blocks, one and two 128-token key blocks, and beyond
SWEEP_LENGTHS = [5, 17, 40, 31, 32, 33, 64, 100, 127, 128, 129, 200, 257, 300]
WARM_LENGTHS = 3  # the graphs a model needs are compiled by then (prefill, decode)


def test_new_prompt_lengths_compile_nothing_after_the_first_few(llama_pair):
    """A sweep of prompt lengths (and the cache lengths their decodes reach) generates the same
    tokens as sdpa and, after the first three lengths, compiles no new graph."""
    from torch._dynamo.utils import counters

    sdpa, flex = llama_pair
    compiled_after = []
    for n, length in enumerate(SWEEP_LENGTHS):
        ids, mask = ragged_batch([length, max(1, length - 3)], 128, 0, seed=100 + n)
        assert_same_generation(sdpa, flex, ids, mask, pad=0)
        compiled_after.append(counters["stats"]["unique_graphs"])
    new_graphs = compiled_after[-1] - compiled_after[WARM_LENGTHS - 1]
    assert new_graphs == 0, f"{new_graphs} graphs compiled for new lengths after the first {WARM_LENGTHS}"


def test_attention_calls_run_their_compiled_graphs_directly(llama_pair):
    """Each layer's call runs the Inductor graph without Dynamo's prologue and AOTAutograd's
    wrappers around it (~50 us of a ~100 us decode call inside a forward): a torch upgrade
    that wraps graphs otherwise must not lose that silently."""
    from flexpage.attention import contiguous
    from flexpage.backends.cpu.saved_programs import SavedProgram

    sdpa, flex = llama_pair
    ids, mask = ragged_batch([40, 37], 128, 0, seed=7)
    assert_same_generation(sdpa, flex, ids, mask, pad=0)
    programs = [p for p in contiguous._COMPILED.values() if isinstance(p, SavedProgram) and p._runners]
    assert len(programs) >= 2, "a prefill and a decode program"
    assert all(p.calls_graphs_directly for p in programs)


def test_whole_model_compiled_with_dynamic_and_static_cache_matches_sdpa(llama_pair):
    """``torch.compile`` around the model (HF's and gpt-fast's recommended path): the attention is
    traced into the model's graph; greedy tokens equal sdpa's with HF's default (dynamic) cache
    and with its static cache (whose query offset is a tensor and whose mask is built ahead)."""
    import torch._dynamo

    sdpa, flex = llama_pair
    ids, mask = ragged_batch([40, 33], 128, 0, seed=7)
    want, _ = greedy(sdpa, ids, mask, pad_token_id=0)
    compiled = copy.copy(flex)  # same modules and weights, own forward
    compiled.forward = torch.compile(flex.forward)
    try:
        for cache in (None, "static"):
            got = compiled.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                    cache_implementation=cache)
            assert got[:, ids.shape[1]:].tolist() == want.tolist(), f"cache_implementation={cache}"
    finally:
        torch._dynamo.reset()
