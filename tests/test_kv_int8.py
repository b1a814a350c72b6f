"""The 8-bit KV cache's attention: int8 pools against a float64 dense reference.

An int8 pool holds ``round(x / scale)`` with one scale per KV head and channel
(:mod:`flexpage.attention.kv_quant`), and attention over it rounds each query row (times the key
scale) to an int8 grid. It must equal, within the query dtype's rounding, float64 attention of
the same grid query over the *dequantised* pool (``int8 * scale``): the quantisation error
itself is the accuracy benchmark's business (``bench/kv_dtype.py``), not the kernel's.
Every batch spec of ``test_paged_attention`` runs decode rows over the pool in place (the
tuned template reading 8-bit blocks) and prefill rows over a gathered copy.
"""

from __future__ import annotations

import pytest
import torch

from attention_reference import BatchSpec, Geometry, PagedCase, reference_paged_attention, rel_err
from flexpage.attention.flex import FlexRunner
from flexpage.attention.kv_pool import KVPool
from flexpage.attention.kv_quant import calibration_scales, dequantize, quantize, scale_output, scale_queries
from flexpage.recipes.causal import causal
from flexpage.recipes.sliding_window import sliding_window

pytestmark = pytest.mark.usefixtures("compile_budget", "single_torch_thread")

DECODE = BatchSpec("decode", seq_lens=(1, 16, 17, 32, 33, 100), query_lens=(1, 1, 1, 1, 1, 1),
                   shared_prefix=((3, 4, 1), (4, 5, 2)))
MIXED = BatchSpec("mixed", seq_lens=(32, 40, 48, 56, 96, 33), query_lens=(1, 1, 5, 5, 40, 33),
                  shared_prefix=((0, 1, 1), (1, 4, 2)))
FP32 = Geometry("fp32-gqa8/2-d64", torch.float32, 8, 2, 64, 1e-5)
BF16 = Geometry("bf16-gqa9/3-d64", torch.bfloat16, 9, 3, 64, 2e-2)


def int8_case(spec: BatchSpec, geometry: Geometry, recipe=None) -> tuple[PagedCase, KVPool]:
    """A float case, and an int8 pool holding its K/V quantised with per-channel scales (keys
    with channel pairs of different ranges, as RoPE'd keys have)."""
    case = PagedCase(spec, geometry, recipe or causal(), page_size=16, num_pages=48, width=8)
    g = torch.Generator().manual_seed(7)
    spread = torch.rand(geometry.kv_heads, geometry.head_dim, generator=g) * 4 + 0.25  # channel ranges differ
    case.k_pool.mul_(spread[:, None].to(geometry.dtype))
    pool = KVPool(num_layers=1, num_blocks=48, block_size=16, num_kv_heads=geometry.kv_heads,
                  head_dim=geometry.head_dim, dtype=torch.int8)
    k_max = case.k_pool[0].float().abs().amax(1)
    v_max = case.v_pool[0].float().abs().amax(1)
    pool.set_scales(torch.stack((calibration_scales(k_max), calibration_scales(v_max, rope_pairs=False)))[None])
    k8, v8 = pool.layer(0)
    k_scale, v_scale = pool.layer_scales(0)
    k8[0].copy_(quantize(case.k_pool[0].transpose(0, 1), k_scale).transpose(0, 1))
    v8[0].copy_(quantize(case.v_pool[0].transpose(0, 1), v_scale).transpose(0, 1))
    return case, pool


def dequantised_reference(case: PagedCase, pool: KVPool, variant=None) -> torch.Tensor:
    """Float64 attention of the grid query (``scale_queries``, the key scale divided out again)
    over the dequantised keys and values."""
    k8, v8 = pool.layer(0)
    k_scale, v_scale = pool.layer_scales(0)
    k = dequantize(k8[0].transpose(0, 1), k_scale).transpose(0, 1)[None]
    v = dequantize(v8[0].transpose(0, 1), v_scale).transpose(0, 1)[None]
    per_head = k_scale.double().repeat_interleave(case.q.shape[1] // k_scale.shape[0], 0)
    q = scale_queries(case.q.double(), k_scale.double()) / per_head
    return reference_paged_attention(q, k, v, case.block_tables, case.spec.seq_lens, case.spec.query_lens,
                                     page_size=16, variant=variant)


@pytest.mark.parametrize("geometry", [FP32, BF16], ids=str)
@pytest.mark.parametrize("spec", [DECODE, MIXED], ids=str)
def test_compiled_attention_over_an_int8_pool_equals_the_dequantised_reference(spec, geometry):
    case, pool = int8_case(spec, geometry)
    k8, v8 = pool.layer(0)
    out = FlexRunner(causal())(case.q, k8, v8, case.batch, pool.layer_scales(0))
    assert out.dtype == geometry.dtype and out.shape == case.q.shape
    assert rel_err(out, dequantised_reference(case, pool)) < geometry.tol


def test_eager_attention_over_an_int8_pool_equals_the_dequantised_reference():
    case, pool = int8_case(MIXED, FP32)
    k8, v8 = pool.layer(0)
    out = FlexRunner(causal(), compile=False)(case.q, k8, v8, case.batch, pool.layer_scales(0))
    assert rel_err(out, dequantised_reference(case, pool)) < FP32.tol


def test_a_recipe_runs_unchanged_over_an_int8_pool():
    """The scales never enter the score: a recipe's mask (here a sliding window) sees the same
    positions as over a float pool."""
    from attention_reference import SlidingWindow

    case, pool = int8_case(DECODE, FP32, sliding_window(24))
    k8, v8 = pool.layer(0)
    out = FlexRunner(sliding_window(24))(case.q, k8, v8, case.batch, pool.layer_scales(0))
    assert rel_err(out, dequantised_reference(case, pool, SlidingWindow(24))) < FP32.tol


def test_the_quantisation_error_is_bounded_by_half_a_step():
    """Within the calibrated range every value is within half a step of its int8 code; beyond it
    values saturate at the range's edge."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 8, generator=g)
    scale = calibration_scales(x.abs().amax(0), rope_pairs=False)
    err = (dequantize(quantize(x, scale), scale) - x).abs()
    assert bool((err <= scale / 2 + 1e-7).all())
    big = quantize(x * 100, scale)
    assert int(big.abs().max()) == 127


def test_scales_fold_into_queries_and_outputs():
    """A query times its KV head's key scale (query head h uses KV head h // group), on a grid of
    127 steps of its row's largest element: within half a step of the exact product, its codes
    whole numbers; the value scale multiplies the output head by head."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 6, 8, generator=g, dtype=torch.float64)
    s = torch.rand(2, 8, generator=g, dtype=torch.float64) + 0.5
    exact = q * s.repeat_interleave(3, 0)
    step = exact.abs().amax(-1, keepdim=True) / 127
    grid = scale_queries(q, s)
    assert bool(((grid - exact).abs() <= step / 2 + 1e-12).all())
    codes = grid / step
    torch.testing.assert_close(codes, codes.round())
    assert float(codes.abs().amax()) == pytest.approx(127)
    torch.testing.assert_close(scale_output(q, s), q * s.repeat_interleave(3, 0))


def test_an_int8_pool_refuses_missing_scales_and_bad_ones():
    case, pool = int8_case(DECODE, FP32)
    k8, v8 = pool.layer(0)
    with pytest.raises(ValueError, match="kv_scales"):
        FlexRunner(causal(), compile=False)(case.q, k8, v8, case.batch)
    with pytest.raises(ValueError, match="scales"):
        pool.set_scales(torch.zeros_like(pool.scales))
    with pytest.raises(ValueError, match="set_scales"):
        case.pool.set_scales(torch.ones(1, 2, FP32.kv_heads, FP32.head_dim))


def test_an_int8_pool_holds_twice_the_tokens_of_bf16_per_byte():
    int8 = KVPool(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.int8)
    bf16 = KVPool(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    assert bf16.bytes_per_token == 2 * int8.bytes_per_token
    assert int8.storage.nbytes * 2 == bf16.storage.nbytes


def test_writes_quantise_with_the_layer_scales():
    pool = KVPool(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=4, dtype=torch.int8)
    pool.set_scales(torch.full((1, 2, 2, 4), 0.5))
    key = torch.tensor([[[1.0, -1.2, 0.2, 100.0]] * 2])
    pool.write(0, torch.tensor([5]), key, -key)
    k8, v8 = pool.layer(0)
    assert k8[0, :, 5].tolist() == [[2, -2, 0, 127]] * 2
    assert v8[0, :, 5].tolist() == [[-2, 2, 0, -127]] * 2


# ---- the engine: calibration, capacity, greedy tokens against HF over the same rounded K/V ----------------


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):
    return tiny_model("llama", num_key_value_heads=2)


def _llm(folder, **overrides):
    from flexpage import LLM

    settings = dict(dtype="float32", block_size=16, num_blocks=24, max_model_len=256, max_num_batched_tokens=32)
    return LLM(model=str(folder), **{**settings, **overrides})


@pytest.mark.parametrize("compile", [True, False], ids=["compiled_step", "eager"])
def test_engine_greedy_tokens_equal_hf_over_the_same_int8_rounding(tiny_llama, compile):
    """Greedy tokens of an int8-cache engine (prompts chunked, a prefix reused) equal HF's argmax
    with each layer's K/V rounded by the engine's own calibrated scales (``round_kv_as_int8``)."""
    from engine_models import hf_greedy, load_reference, random_prompts, round_kv_as_int8
    from flexpage import SamplingParams

    prompts = random_prompts((5, 40, 70), seed=3)
    prompts.append(prompts[2][:48] + [7, 8, 9])  # a cached prefix of three blocks
    llm = _llm(tiny_llama, kv_cache_dtype="int8", compile=compile)
    try:
        runner = llm.engine.runner
        assert runner.pool.dtype == torch.int8 and (runner.compiled_step is not None) == compile
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        reference = round_kv_as_int8(load_reference(tiny_llama), runner.pool.scales)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, 12, stop_at_eos=False)
                                                             for p in prompts]
        assert llm.engine.stats()["prefix_cache_hits"] > 0
        assert llm.engine.block_manager.stats().used == 0
    finally:
        llm.engine.close()


def test_calibrated_scales_cover_the_calibration_keys_with_headroom(tiny_llama):
    """Each layer's scales come from a forward over the calibration text: the largest key and
    value of every channel (RoPE pairs sharing one range) fits in 127 steps with room to spare,
    and is not so small a step that it wastes most of the range."""
    from engine_models import load_reference
    from flexpage.model.compact import CompactDecoder
    from flexpage.model.kv_calibration import calibrate_kv_scales

    decoder = CompactDecoder(load_reference(tiny_llama))
    ids = list(range(3, 300))
    scales = calibrate_kv_scales(decoder, ids)
    assert scales.shape == (2, 2, 2, 16) and bool((scales > 0).all())
    half = 8
    torch.testing.assert_close(scales[:, 0, :, :half], scales[:, 0, :, half:])  # key pairs share a range
    recorded = {}

    def attend(layer, q, k, v):  # the calibration forward again, recording each layer's maxima
        recorded[layer] = (k.abs().amax(0), v.abs().amax(0))
        g = decoder.num_heads // decoder.num_kv_heads
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1),
            is_causal=True, scale=decoder.scale).transpose(0, 1)

    decoder.forward(torch.tensor(ids), torch.arange(len(ids)), torch.tensor([0]), attend)
    for layer, (k_max, v_max) in recorded.items():
        assert bool((k_max <= 127 * scales[layer, 0]).all()) and bool((v_max <= 127 * scales[layer, 1]).all())
        assert bool((v_max >= 0.5 * 127 * scales[layer, 1]).all())  # values' own maxima use most of the range


def test_an_int8_cache_holds_twice_the_tokens_in_the_same_memory(tiny_llama):
    """``kv_cache_memory`` is a byte budget: the int8 cache fits twice the tokens of the model's dtype."""
    sizes = {}
    for dtype in ("auto", "int8"):
        llm = _llm(tiny_llama, kv_cache_dtype=dtype, num_blocks=None, kv_cache_memory="4MiB", compile=False)
        try:
            sizes[dtype] = llm.engine.stats()["kv_capacity_tokens"]
        finally:
            llm.engine.close()
    assert sizes["int8"] >= 1.9 * sizes["auto"]


def test_an_int8_cache_is_refused_where_it_cannot_run(tiny_model):
    from flexpage.features import UnsupportedCombination

    with pytest.raises(ValueError, match="kv_cache_dtype: got 'fp4'"):
        _llm(tiny_model("llama"), kv_cache_dtype="fp4")
    with pytest.raises(UnsupportedCombination, match="deterministic=True cannot be combined with kv_cache_dtype='int8'"):
        _llm(tiny_model("llama"), kv_cache_dtype="int8", deterministic=True)
    with pytest.raises(ValueError, match="one kind of attention layer"):
        _llm(tiny_model("gemma2"), kv_cache_dtype="int8", compile=False)
