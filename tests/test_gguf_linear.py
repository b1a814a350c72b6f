"""Weights that run from a GGUF's Q4_0, Q4_1 and Q8_0 blocks (:mod:`flexpage.model.gguf_linear`).

* The blocks expand to the weights GGUF's own dequantisation gives, and the kernel computes
  ``x @ W.T + bias`` with them to float32 rounding (against float64), for any row count.
* A projection given blocks keeps the blocks only (no float32 weight) and computes from them;
  an embedding kept as blocks gives exactly its table's rows. bf16 rows computed from the
  blocks see exactly the bf16 model's weights (on the bf16 panels) and match float64 to bf16
  rounding; up to 4 rows, quantised to 16-bit integers per 32-wide block, err by at most 2^-15
  of a block's largest input (and infinities and NaNs come out as float64 gives them). Rows
  from ``valid_rows`` on (a compiled step's padding) are left zero, not computed. A Q4_0 block is read as the Q4_1 block with ``m = -8 d``: the same weights. Where the blocks do not serve every row count in bf16, a bf16 projection packed
  for oneDNN keeps both and computes up to ``MAX_BLOCK_ROWS`` rows from the blocks, more from
  the packed weight: eagerly and in a compiled graph, the same bits.
* The tensor table is read as ``gguf.GGUFReader`` reads it (without its metadata values).
* :func:`gguf_blocks` returns a model's blocks only where they expand to exactly its float32
  weights (or round to exactly its bf16 ones), undoing llama.cpp's q/k row permutation; a
  tied LM head gets the embedding's.
* Through the engine, a GGUF model reads its blocks (projections and LM head; eager and
  compiled steps) and gives HF ``generate``'s greedy tokens, also from compiled steps a
  previous engine saved; ``quantization="none"`` keeps float32 only.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from engine_models import greedy_in_two_processes, hf_greedy, load_reference, random_prompts
from flexpage import SamplingParams
from flexpage.model import gguf_linear
from gguf_models import LAYERS, random_blocks, write_tiny_gguf

pytestmark = pytest.mark.skipif(not gguf_linear.available(),
                                reason="the block kernel needs an x86 CPU with AVX2/FMA/F16C and a C++ compiler")

KINDS = ("Q4_0", "Q4_1", "Q8_0")
PROMPTS = random_prompts((5, 17, 33, 60), seed=5)
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def _blocks(kind: str, rows: int, features: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_blocks(np.random.default_rng(seed), kind, rows, features))


@pytest.mark.parametrize("kind", (*KINDS, "Q6_K"))
def test_blocks_expand_to_ggufs_own_dequantisation(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    features = 512 if kind == "Q6_K" else 96  # Q6_K: super-blocks of 256
    raw = _blocks(kind, 24, features)
    expected = dequantize(raw.numpy(), GGMLQuantizationType[kind]).reshape(24, features)
    assert torch.equal(gguf_linear.expand(kind, raw), torch.from_numpy(expected))


@pytest.mark.parametrize("kind", KINDS)
def test_repacked_blocks_keep_codes_and_widen_scales_exactly(kind):
    raw = _blocks(kind, 3, 64)
    scales = 2 if kind == "Q4_1" else 1
    packed = gguf_linear.repack(kind, raw).view(3, 2, gguf_linear.BLOCK_BYTES[kind])
    gguf = raw.view(3, 2, gguf_linear.GGUF_BLOCK_BYTES[kind])
    assert torch.equal(packed[..., 4 * scales:], gguf[..., 2 * scales:])
    assert torch.equal(packed[..., :4 * scales].contiguous().view(torch.float32),
                       gguf[..., :2 * scales].contiguous().view(torch.float16).float())


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 40])
def test_q6_k_super_blocks_run_as_blocks_with_a_scale_per_16_weights(rows):
    """Q6_K (llama.cpp's default for a Q4_0 model's tied embedding and LM head) is read as
    ``Q8_16`` blocks: the same weights (float32 and bf16), float32 rows to float64 and bf16
    rows to the bf16 weights, on every path (16-wide rows, AMX tiles or bf16 panels)."""
    raw = _blocks("Q6_K", 64, 512, seed=rows)
    blocks, weight = gguf_linear.repack("Q6_K", raw), gguf_linear.expand("Q6_K", raw)
    assert blocks.shape == (64, 512 // 32 * gguf_linear.BLOCK_BYTES["Q8_16"])
    assert torch.ops.flexpage.blocks_match(blocks, weight)
    assert torch.ops.flexpage.blocks_match(blocks, weight.bfloat16())
    moved = weight.clone()
    moved.view(torch.int32)[7, 300] += 1
    assert not torch.ops.flexpage.blocks_match(blocks, moved)
    x = torch.randn(rows, 512)
    torch.testing.assert_close(gguf_linear.block_linear(x, blocks).double(), x.double() @ weight.double().T,
                               rtol=1e-5, atol=1e-5)
    bf16 = x.bfloat16()
    expected = (bf16.double() @ weight.bfloat16().double().T).to(torch.bfloat16)
    torch.testing.assert_close(gguf_linear.block_linear(bf16, blocks), expected, rtol=1.6e-2, atol=1e-2)
    assert torch.equal(gguf_linear.embedding(torch.tensor([0, 9, 63]), blocks, 512), weight[[0, 9, 63]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_blocks_match_the_weight_they_expand_to_and_no_weight_one_unit_in_the_last_place_away(kind, dtype):
    """How :func:`gguf_blocks` checks a model's weights (bf16: rounded to nearest-even, as torch rounds)."""
    raw = _blocks(kind, 24, 64)
    blocks, weight = gguf_linear.repack(kind, raw), gguf_linear.expand(kind, raw).to(dtype)
    assert torch.ops.flexpage.blocks_match(blocks, weight)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for row, col in ((0, 0), (23, 63), (11, 37)):
        moved = weight.clone()
        moved.view(bits)[row, col] += 1
        assert not torch.ops.flexpage.blocks_match(blocks, moved), (row, col)
    assert not torch.ops.flexpage.blocks_match(blocks, weight[:, :32])  # blocks of another width


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 64), (8, 96), (130, 32), (48, 64), (16, 2048)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13, 17, 100])
def test_kernel_matches_float64_for_any_row_count(kind, out_features, in_features, rows):
    """Up to 12 rows per-output dot products; beyond, 16-output panels (out_features a multiple
    of 16) in tiles of 6 rows and tails, in several passes over x where it is wide (16 x 2048)."""
    raw = _blocks(kind, out_features, in_features, seed=rows)
    weight = gguf_linear.expand(kind, raw).double()
    x, bias = torch.randn(rows, in_features), torch.randn(out_features)
    out = gguf_linear.block_linear(x, gguf_linear.repack(kind, raw), bias)
    expected = x.double() @ weight.T + bias.double()
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_projection_with_blocks_keeps_only_the_blocks():
    from flexpage.model.packed_linear import PackedLinear

    raw = _blocks("Q4_1", 48, 64)
    weight, bias = gguf_linear.expand("Q4_1", raw), torch.randn(48)
    linear = PackedLinear(weight, bias, blocks=gguf_linear.repack("Q4_1", raw))
    assert linear.weight is None and linear.blocks is not None and linear.owns_weight and not linear.packed
    for rows in (1, 13, 200):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x).double(), x.double() @ weight.double().T + bias.double(),
                                   rtol=1e-5, atol=1e-5)
    # where blocks cannot serve (row tiles, unpacked comparisons) the float32 weight stays
    assert PackedLinear(weight, bias, prepack=False, blocks=linear.blocks).blocks is None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 64), (96, 2048), (37, 64), (130, 32)])
def test_bf16_rows_see_exactly_the_bf16_models_weights(kind, out_features, in_features):
    """One-hot rows pick single weights, so each output is one weight plus its bias, rounded once:
    on the bf16 panels (AVX512-BF16, outputs a multiple of 32) the weights are the bf16 model's
    own, each in its place; elsewhere bf16 rows run in float32 from the unrounded weights."""
    raw = _blocks(kind, out_features, in_features)
    weight, bias = gguf_linear.expand(kind, raw), torch.randn(out_features).bfloat16()
    x = torch.eye(in_features).bfloat16()
    out = gguf_linear.block_linear(x, gguf_linear.repack(kind, raw), bias)
    assert out.dtype == torch.bfloat16 and out.shape == (in_features, out_features)
    panels = torch.ops.flexpage.has_bf16_panels() and out_features % 32 == 0
    seen = weight.bfloat16().float() if panels else weight
    assert torch.equal(out, (seen.T + bias.float()).bfloat16())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_bf16_rows_up_to_four_round_each_weight_plus_bias_once(kind, rows):
    """One-hot rows give each output exactly one float32 weight plus its bias, rounded to
    nearest-even once (what Tensor.to(bfloat16) gives): where the CPU has AVX512-BF16 the few-row
    kernel widens x and rounds y itself, elsewhere the float32 path runs between two copies."""
    raw = _blocks(kind, 96, 128, seed=rows)
    weight, bias = gguf_linear.expand(kind, raw), torch.randn(96).bfloat16()
    x = torch.eye(128)[[5, 77, 0, 127][:rows]].bfloat16()
    out = gguf_linear.block_linear(x, gguf_linear.repack(kind, raw), bias)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (weight[:, [5, 77, 0, 127][:rows]].T + bias.float()).bfloat16())
    no_bias = gguf_linear.block_linear(x, gguf_linear.repack(kind, raw), None)
    assert torch.equal(no_bias, weight[:, [5, 77, 0, 127][:rows]].T.bfloat16())


@pytest.mark.parametrize("rows", [1, 33])  # bf16: the few-row kernel and the panels
def test_a_bias_of_the_wrong_length_is_refused(rows):
    blocks = gguf_linear.repack("Q4_1", _blocks("Q4_1", 64, 64))
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(RuntimeError, match="bias has 63 values, the blocks 64 outputs"):
            gguf_linear.block_linear(torch.randn(rows, 64, dtype=dtype), blocks, torch.randn(63, dtype=dtype))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("in_features", [256, 96])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 13, 16, 17, 25, 40, 64, 100])
def test_bf16_rows_match_float64_to_bf16_rounding(kind, rows, in_features):
    """Up to 4 rows in float32 then rounded (two blocks a step, and an odd block's tail); more on
    the bf16 panels (tiles of 12 rows and a tail), or where the CPU has AMX, 5-64 rows on its
    tiles (groups of 16 rows, the last one partial or whole)."""
    raw = _blocks(kind, 96, in_features, seed=rows)
    weight = gguf_linear.expand(kind, raw).bfloat16().double()
    x, bias = torch.randn(rows, in_features).bfloat16(), torch.randn(96).bfloat16()
    out = gguf_linear.block_linear(x, gguf_linear.repack(kind, raw), bias)
    expected = x.double() @ weight.T + bias.double()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=2**-8 * expected.abs().max().item())


@pytest.mark.parametrize("kind", (*KINDS, "Q6_K"))
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_few_bf16_rows_err_by_at_most_two_to_the_minus_15_of_each_blocks_largest_input(kind, rows):
    """Up to 4 bf16 rows may run as integers (AVX512-VNNI): each 32-wide block of x as int16 codes
    times a power of two, exact for inputs within 2^7 of the block's largest and off by at most
    2^-15 of it below. Inputs spanning 2^30 within a block (and a block of zeros) stay inside that
    bound plus the result's bf16 rounding; 8-bit inputs, as llama.cpp's, would not."""
    in_features = 256
    raw = _blocks(kind, 64, in_features, seed=rows)
    weight = gguf_linear.expand(kind, raw).double()
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator) * 2.0 ** torch.randint(-20, 10, (rows, in_features),
                                                                                     generator=generator)
    x[:, 32:64] = 0
    x = x.bfloat16()
    bias = torch.randn(64).bfloat16()
    out = gguf_linear.block_linear(x, gguf_linear.repack(kind, raw), bias).double()
    exact = x.double() @ weight.T + bias.double()
    block_largest = x.double().abs().reshape(rows, -1, 32).amax(-1).repeat_interleave(32, -1)
    input_error = (block_largest * 2.0 ** -15) @ weight.abs().T
    sum_error = 2.0 ** -20 * (x.double().abs() @ weight.abs().T)  # float32 sums of the blocks
    assert torch.all((out - exact).abs() <= exact.abs() * 2.0 ** -8 + input_error + sum_error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "valid"), [(2, 1), (8, 5), (3, 0), (4, 4), (2, 9)])
def test_rows_from_valid_rows_on_are_padding_left_zero(dtype, rows, valid):
    """A compiled step pads a batch-1 decode to two rows; told how many are real, the kernel
    computes those (the same bits as alone) and leaves the padding zero."""
    blocks = gguf_linear.repack("Q4_1", _blocks("Q4_1", 64, 96))
    x, bias = torch.randn(rows, 96, dtype=dtype), torch.randn(64, dtype=dtype)
    out = gguf_linear.block_linear(x, blocks, bias, torch.tensor(valid))
    computed = min(valid, rows)
    assert torch.equal(out[:computed], gguf_linear.block_linear(x[:computed], blocks, bias))
    assert torch.equal(out[computed:], torch.zeros(rows - computed, 64, dtype=dtype))
    with pytest.raises(RuntimeError, match="valid_rows must hold one integer"):
        gguf_linear.block_linear(x, blocks, bias, torch.tensor([1, 2]))


@pytest.mark.parametrize("rows", [3, 30])  # bf16: the few-row kernel and the panels
def test_bf16_rows_holding_an_infinity_or_nan_give_what_float64_gives(rows):
    """Inputs are never quantised past an infinity or NaN: such calls run in float32."""
    raw = _blocks("Q4_1", 64, 64)
    weight = gguf_linear.expand("Q4_1", raw).double()
    x = torch.randn(rows, 64).bfloat16()
    x[0, 3], x[1, 40] = float("inf"), float("nan")
    out = gguf_linear.block_linear(x, gguf_linear.repack("Q4_1", raw), None).double()
    exact = x.double() @ weight.T
    assert torch.equal(out.isnan(), exact.isnan()) and torch.equal(out[exact.isinf()], exact[exact.isinf()])
    torch.testing.assert_close(out[2:], exact[2:], rtol=2**-7, atol=2**-8 * exact[2:].abs().max().item())


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 kernels on this CPU")
def test_a_bf16_projection_keeps_a_packed_weight_only_where_the_blocks_do_not_serve_every_row():
    """Where the blocks serve every row count (bf16 panels, no AMX) a bf16 projection keeps its
    blocks only. Elsewhere it keeps oneDNN's packed weight too: the few rows of a small decode
    batch are memory-bound and read the blocks (~40% of bf16's bytes), and from
    ``MAX_BLOCK_ROWS`` on the packed weight's result, eagerly and compiled alike (on AMX CPUs,
    5-64 rows run the blocks on the AMX tiles, which sum as oneDNN's tiles do: the same bits)."""
    from flexpage.model.packed_linear import PackedLinear

    raw = _blocks("Q4_1", 64, 64)
    weight, bias = gguf_linear.expand("Q4_1", raw).bfloat16(), torch.randn(64).bfloat16()
    blocks = gguf_linear.repack("Q4_1", raw)
    linear = PackedLinear(weight, bias, blocks=blocks)
    blocks_only = gguf_linear.blocks_at_every_row(torch.bfloat16)
    assert linear.blocks is not None and linear.owns_weight and linear.packed is not blocks_only
    assert (linear.weight is None) is blocks_only
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    compiled = torch.compile(gguf_linear.block_or_packed_linear, dynamic=True, fullgraph=True)
    for rows in (1, 2, gguf_linear.MAX_BLOCK_ROWS, gguf_linear.MAX_BLOCK_ROWS + 1, 16, 48,
                 gguf_linear.MAX_TILE_ROWS, gguf_linear.MAX_TILE_ROWS + 1):
        x = torch.randn(rows, 64).bfloat16()
        from_blocks = gguf_linear.block_linear(x, blocks, bias)
        assert torch.equal(linear(x), from_blocks if blocks_only or rows <= gguf_linear.MAX_BLOCK_ROWS
                           else torch.ops.mkldnn._linear_pointwise(x, linear.weight, bias, "none", [], "")), rows
        expected = (from_blocks if rows <= gguf_linear.MAX_BLOCK_ROWS
                    else torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""))
        assert torch.equal(gguf_linear.block_or_packed_linear(x, blocks, packed, bias), expected), rows
        assert torch.equal(compiled(x, blocks, packed, bias), expected), rows
    # without oneDNN's bf16 packing (prepack=False) a bf16 layer keeps its weight only
    assert PackedLinear(weight, bias, prepack=False, blocks=blocks).blocks is None


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_rows_from_blocks_are_the_tables_rows_exactly(kind):
    raw = _blocks(kind, 50, 96)
    token_ids = torch.tensor([3, 0, 49, 3, 17])
    rows = gguf_linear.embedding(token_ids, gguf_linear.repack(kind, raw), 96)
    assert rows.dtype == torch.float32 and torch.equal(rows, gguf_linear.expand(kind, raw)[token_ids])


def test_bad_inputs_are_refused_naming_what_is_wrong():
    blocks = gguf_linear.repack("Q4_1", _blocks("Q4_1", 8, 64))
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16, got Double"):
        gguf_linear.block_linear(torch.randn(2, 64, dtype=torch.float64), blocks)
    with pytest.raises(RuntimeError, match=r"x has 96 features .* 72 \(Q4_1\).* bytes per row; got 48"):
        gguf_linear.block_linear(torch.randn(2, 96), blocks)
    with pytest.raises(RuntimeError, match="blocks must be a contiguous uint8"):
        gguf_linear.block_linear(torch.randn(2, 64), blocks.float())
    with pytest.raises(ValueError, match=r"30 bytes per 32 weights, none of the kernel's formats .*'Q4_1': 24"):
        gguf_linear.embedding(torch.tensor([0]), torch.zeros(4, 60, dtype=torch.uint8), 64)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> pathlib.Path:
    from flexpage.model.loader import _default_gguf_path

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", _default_gguf_path())


@pytest.fixture(scope="module")
def tiny_gguf_folder(tiny_gguf) -> pathlib.Path:
    from flexpage.model.loader import resolve_model_path

    return resolve_model_path(tiny_gguf)


def test_the_tensor_table_is_read_as_ggufs_own_reader_reads_it(tiny_gguf, tmp_path):
    from gguf import GGUFReader

    from flexpage.model.gguf_file import gguf_tensors

    ours, theirs = list(gguf_tensors(tiny_gguf)), GGUFReader(tiny_gguf).tensors
    assert [(t.name, t.type_name, t.shape) for t in ours] == [
        (t.name, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape))) for t in theirs]
    assert all(np.array_equal(a.data, np.asarray(b.data).view(np.uint8).reshape(-1)) for a, b in zip(ours, theirs))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        next(gguf_tensors(not_gguf))


def test_the_default_models_folder_finds_the_installed_gguf_when_the_one_it_was_converted_from_is_gone(
        tmp_path, monkeypatch):
    """The default folder is shared by every environment; the one that converted it may be deleted."""
    from flexpage.model import loader

    monkeypatch.setenv(loader.CACHE_ENV_VAR, str(tmp_path))
    packaged = loader._default_gguf_path()
    default, other = loader.default_model_dir(), tmp_path / "other-model"

    def record(folder: pathlib.Path, size: int) -> None:
        folder.mkdir(exist_ok=True)
        (folder / loader._PROVENANCE_FILE).write_text(json.dumps(
            {"source_gguf": str(tmp_path / "deleted-venv" / packaged.name), "size": size, "mtime_ns": 1}))

    record(default, packaged.stat().st_size)
    record(other, packaged.stat().st_size)
    assert loader.gguf_source(default) == packaged
    assert loader.gguf_source(other) is None  # any other folder: only the file it was made from
    record(default, packaged.stat().st_size + 1)
    assert loader.gguf_source(default) is None  # not the file it was converted from


def test_a_models_blocks_are_found_only_where_they_give_its_exact_weights(tiny_gguf, tiny_gguf_folder):
    from flexpage.model.loader import gguf_source, load_hf_model

    assert gguf_source(tiny_gguf_folder) == tiny_gguf.resolve()
    model = load_hf_model(tiny_gguf_folder, torch.float32)
    blocks = gguf_linear.gguf_blocks(tiny_gguf, model)
    params = dict(model.named_parameters(remove_duplicate=False))
    # q, k (stored permuted), v, o, gate, up, down per layer; the embedding, tied to the LM head
    assert len(blocks) == LAYERS * 7 + 2 and blocks["lm_head.weight"] is blocks["model.embed_tokens.weight"]
    for name, found in blocks.items():  # expanding the kernel's blocks gives the weight
        x = torch.eye(params[name].shape[1])
        assert torch.equal(gguf_linear.block_linear(x, found), params[name].T), name
    with torch.no_grad():
        params["model.layers.1.mlp.up_proj.weight"][0, 0] += 1e-3
    assert set(gguf_linear.gguf_blocks(tiny_gguf, model)) == set(blocks) - {"model.layers.1.mlp.up_proj.weight"}
    rounded = load_hf_model(tiny_gguf_folder, torch.bfloat16)  # the same weights, rounded to bf16
    assert set(gguf_linear.gguf_blocks(tiny_gguf, rounded)) == set(blocks)
    with torch.no_grad():
        rounded.model.layers[0].self_attn.o_proj.weight[0, 0] += 0.5
    assert set(gguf_linear.gguf_blocks(tiny_gguf, rounded)) == set(blocks) - {"model.layers.0.self_attn.o_proj.weight"}


@pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")
@pytest.mark.parametrize("compile", [False, True])
def test_a_gguf_model_reads_its_blocks_and_gives_hf_greedy_tokens(compile, tiny_gguf, tiny_gguf_folder, llm_factory):
    llm = llm_factory(tiny_gguf, compile=compile, num_blocks=128)
    compact = llm.engine.runner.compact
    linears = [compact.lm_head, *(linear for layer in compact.layers
                                  for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))]
    assert all(linear.blocks is not None and linear.weight is None for linear in linears)
    assert compact.embed is None and compact.embed_blocks is not None  # the Q8_0 embedding, looked up from blocks
    assert (llm.engine.runner.compiled_step is not None) == compile
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    reference = load_reference(tiny_gguf_folder)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.usefixtures("single_torch_thread")
def test_the_next_engine_loads_the_compiled_steps_the_first_saved(tiny_gguf, tiny_gguf_folder, monkeypatch, tmp_path):
    """A later process skips Dynamo's tracing (:mod:`flexpage.backends.cpu.saved_programs`): the second
    engine compiles nothing, reads the first one's programs, and gives the same greedy tokens."""
    from flexpage import LLM

    tokens, saved = greedy_in_two_processes(
        lambda: LLM(str(tiny_gguf), dtype="float32", compile=True, num_blocks=128), PROMPTS, GREEDY, tmp_path, monkeypatch)
    assert saved[0] and saved[1] == saved[0]  # the first engine saved programs, the second added none
    reference = load_reference(tiny_gguf_folder)
    assert tokens[0] == tokens[1] == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 kernels on this CPU")
@pytest.mark.usefixtures("single_torch_thread")
def test_a_bf16_models_compiled_steps_give_the_layer_by_layer_logits_from_blocks_and_packed_weights(
        tiny_gguf, tiny_gguf_folder):
    """Two decode rows read the blocks, a prefill and six decode rows the packed bf16 weights
    where the model keeps both (else the blocks too): one graph per kind of step serves both
    (rows are padded to at least two, not to a bucket). The compiled graph rounds fused
    elementwise ops once, eager code after every op."""
    from test_compiled_step import _both_ways

    from flexpage.model.loader import load_hf_model
    from flexpage.model.runner import ModelRunner, StepInputs

    runner = ModelRunner(load_hf_model(tiny_gguf_folder, torch.bfloat16), num_blocks=64, block_size=8, compile=True,
                         blocks_per_attention_block=2, gguf_path=str(tiny_gguf))
    qkv = runner.compact.layers[0].qkv
    assert qkv.blocks is not None and qkv.packed is not gguf_linear.blocks_at_every_row(torch.bfloat16)
    assert runner.compiled_step._padded_rows(1) == 2
    tables = [[4 * i + j + 1 for j in range(4)] for i in range(6)]
    prompts = random_prompts([9, 20, 7, 11, 5, 13], seed=6)
    steps = [
        StepInputs(token_ids=sum(prompts, []), block_tables=tables, seq_lens=[len(p) for p in prompts],
                   query_lens=[len(p) for p in prompts], sample_rows=list(np.cumsum([len(p) for p in prompts]) - 1)),
        StepInputs(token_ids=[11, 12], block_tables=tables[:2], seq_lens=[10, 21], query_lens=[1, 1], sample_rows=[0, 1]),
        StepInputs(token_ids=list(range(20, 26)), block_tables=tables, seq_lens=[len(p) + 1 for p in prompts],
                   query_lens=[1] * 6, sample_rows=list(range(6))),
    ]
    for inputs in steps:
        compiled, compiled_pool, layered, layered_pool = _both_ways(runner, inputs)
        # bf16 logits are rounded at their own scale (this model's reach ~50: a unit in the last place is 0.25)
        torch.testing.assert_close(compiled, layered, rtol=2e-2, atol=1e-2 * layered.abs().max().item())
        torch.testing.assert_close(compiled_pool, layered_pool, rtol=2e-2, atol=5e-2)
        runner.pool.storage.copy_(compiled_pool)


@pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")
def test_quantization_none_keeps_float32_weights_only(tiny_gguf, llm_factory):
    llm = llm_factory(tiny_gguf, quantization="none")
    compact = llm.engine.runner.compact
    assert compact.lm_head.blocks is None and all(layer.qkv.blocks is None for layer in compact.layers)
    with pytest.raises(ValueError, match="quantization: got 'q4'"):
        llm_factory(tiny_gguf, quantization="q4")
