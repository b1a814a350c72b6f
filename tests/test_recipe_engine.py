"""Recipes as the engine's input: a recipe from ``recipes/`` runs in ``LLM.generate``.

Reference: the same HF checkpoint in float32 with a dense float64 attention function that
applies the recipe's ``mask_mod``/``score_mod`` to every (query, key) pair of the whole
sequence (no paging, no block rules, no cache), greedy tokens by plain argmax.
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch
from engine_models import hf_greedy, load_reference, random_prompts
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from flexpage import SamplingParams
from flexpage.attention.recipe import Recipe
from flexpage.model.layer_recipes import engine_recipes, load_recipe, model_recipes, parse_recipe_option
from flexpage.recipes import attention_sinks, causal, chunked_local

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPT = random_prompts([40], seed=11)[0]
NEW_TOKENS = 8
DENSE = "flexpage_test_dense_recipe"


def dense_recipe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,  # noqa: ANN001
                           **kwargs):
    """One unpadded sequence, float64: the recipe of ``module.layer_idx`` over every position."""
    recipe: Recipe = module.config.flexpage_test_recipes[module.layer_idx]
    q_len, kv_len = query.shape[2], key.shape[2]
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    kv_pos = torch.arange(kv_len)[None, :]
    heads = torch.arange(query.shape[1])[:, None, None]
    group = query.shape[1] // key.shape[1]
    k, v = (t[0].double().repeat_interleave(group, 0) for t in (key, value))
    scores = query[0].double() @ k.transpose(-1, -2) * scaling
    b = torch.tensor(0)
    if recipe.score_mod is not None:
        scores = recipe.score_mod(scores, b, heads, q_pos, kv_pos)
    if recipe.mask_mod is not None:
        scores = scores.masked_fill(~recipe.mask_mod(b, heads, q_pos, kv_pos), float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return out.to(query.dtype).transpose(0, 1)[None].contiguous(), None


AttentionInterface.register(DENSE, dense_recipe_attention)
AttentionMaskInterface.register(DENSE, lambda *args, **kwargs: None)


def dense_greedy(folder, recipes: tuple[Recipe, ...]) -> list[int]:  # noqa: ANN001
    model = load_reference(folder)
    model.config.flexpage_test_recipes = recipes
    model.set_attn_implementation(DENSE)
    return hf_greedy(model, PROMPT, NEW_TOKENS, stop_at_eos=False)


def engine_greedy(llm_factory, folder, recipe) -> tuple[list[int], object]:  # noqa: ANN001
    llm = llm_factory(model=str(folder), dtype="float32", recipe=recipe, block_size=4)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                       ignore_eos=True))
    return out[0].outputs[0].token_ids, llm.engine


@pytest.mark.parametrize("recipe, window", [(chunked_local(8), 8), (attention_sinks(4, 8), None)],
                         ids=["chunked_local", "attention_sinks"])
def test_a_recipe_generates_what_dense_attention_generates(tiny_model, llm_factory, recipe, window):
    """Over a 40-token prompt: Llama-4-style chunks of 8 (the recipe declares a window, so the
    engine gives back the blocks behind it) and StreamingLLM's 4 sinks + a window of 8 (the
    sinks stay: nothing is released)."""
    folder = tiny_model("llama")
    expected = dense_greedy(folder, (recipe, recipe))
    assert expected != dense_greedy(folder, model_recipes(load_reference(folder).config)), "indistinguishable"
    got, engine = engine_greedy(llm_factory, folder, recipe)
    assert got == expected
    assert [g.window for g in engine.layer_groups] == [window]
    assert (engine.block_manager.stats().released_window_blocks > 0) == (window is not None)


def test_two_recipes_with_one_name_never_share_kernels(tiny_model, llm_factory):
    """A user's parameterised recipe with a constant name (as ``prefix_lm`` and ``document_mask``
    have): layer 0 sees chunks of 16, layer 1 chunks of 8. Each layer must get its own kernel
    and batch plan, or layer 1 would attend with layer 0's chunks."""
    folder = tiny_model("llama")
    first = dataclasses.replace(chunked_local(16), name="local", window=None)
    second = dataclasses.replace(chunked_local(8), name="local", window=None)
    assert first != second and hash(first) != hash(second)
    expected = dense_greedy(folder, (first, second))
    assert expected != dense_greedy(folder, (first, first)), "indistinguishable"
    got, _ = engine_greedy(llm_factory, folder, (first, second))
    assert got == expected


def test_a_recipe_is_named_by_module_attribute_or_file(tmp_path):
    assert load_recipe("flexpage.recipes.causal:causal") is causal()
    with pytest.raises(ValueError, match="takes arguments"):
        load_recipe("flexpage.recipes:chunked_local")  # a factory needing arguments: name a Recipe instead
    path = tmp_path / "my_recipe.py"
    path.write_text(textwrap.dedent("""
        from flexpage.recipes import chunked_local
        mine = chunked_local(16)
    """))
    assert load_recipe(str(path)).name == "chunked_local(16)"
    assert load_recipe(f"{path}:mine").window == 16


@pytest.mark.parametrize("spec, message", [
    ("flexpage.recipes.causal", "expected 'package.module:attr'"),
    ("flexpage.nope:x", "cannot import"),
    ("flexpage.recipes.causal:nope", "has no attribute 'nope'"),
    ("flexpage.recipes.causal:CAUSAL_X", "has no attribute"),
    ("missing_file.py", "no file"),
    ("flexpage.config:DEFAULT_BLOCK_SIZE", "gave a int, expected a Recipe"),
])
def test_a_bad_recipe_name_says_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        load_recipe(spec)


def test_one_recipe_per_layer_must_match_the_layer_count(tiny_model):
    config = load_reference(tiny_model("llama")).config
    assert engine_recipes(None, config) == model_recipes(config)
    assert engine_recipes(causal(), config) == (causal(),) * 2
    with pytest.raises(ValueError, match="one per layer"):
        engine_recipes([causal()] * 3, config)


def test_a_recipe_can_replace_one_layer_kind(tiny_model, llm_factory):
    """Gemma2's sliding layers run Llama-4-style chunks, its global layers keep the model's own
    recipe (causal + soft-capping): the engine generates what dense attention with those
    recipes generates."""
    folder = tiny_model("gemma2")
    config = load_reference(folder).config
    own = model_recipes(config)
    local = chunked_local(8)
    chosen = engine_recipes({"sliding_attention": local}, config)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert chosen == (local, own[1])
    expected = dense_greedy(folder, chosen)
    assert expected != dense_greedy(folder, own), "indistinguishable"
    got, _ = engine_greedy(llm_factory, folder, {"sliding_attention": local})
    assert got == expected


def test_a_layer_kind_the_model_lacks_is_refused(tiny_model):
    config = load_reference(tiny_model("llama")).config
    with pytest.raises(ValueError, match="no layer of this model is 'sliding_attention'; its layers are full_attention"):
        engine_recipes({"sliding_attention": causal()}, config)


@pytest.mark.parametrize("values, choice", [
    (None, None),
    (["recipes/chunked_local.py"], "recipes/chunked_local.py"),
    (["sliding_attention=a:b", "full_attention=c.py"], {"sliding_attention": "a:b", "full_attention": "c.py"}),
])
def test_the_recipe_option_names_one_recipe_or_one_per_kind(values, choice):
    assert parse_recipe_option(values) == choice


@pytest.mark.parametrize("values, message", [
    (["a:b", "c:d"], "one recipe for every layer, or KIND=RECIPE"),
    (["sliding_attention=a:b", "c:d"], "one recipe for every layer, or KIND=RECIPE"),
    (["local=a:b"], "unknown layer kind 'local'"),
    (["full_attention=a:b", "full_attention=c:d"], "named twice"),
])
def test_a_bad_recipe_option_says_what_is_wrong(values, message):
    with pytest.raises(ValueError, match=message):
        parse_recipe_option(values)


def test_hf_attention_arguments_must_match_the_models_own_recipes():
    """HF's modules pass each call's window and soft cap; with the model's recipes they must ask
    for exactly the layer's recipe (the block manager released blocks by it), with a user's
    recipe the user's wins."""
    from flexpage.model.layer_recipes import recipe_for
    from flexpage.model.runner import PagedStep

    windowed = recipe_for(12, None)
    step = PagedStep(pool=None, block_tables=None, seq_lens=None, query_lens=None, compile=False,
                     recipes=(windowed,), recipes_from_model=True)
    assert step.recipe_of(0, 12, None) is windowed
    with pytest.raises(ValueError, match="read wrong"):
        step.recipe_of(0, None, None)
    mine = chunked_local(8)
    step = PagedStep(pool=None, block_tables=None, seq_lens=None, query_lens=None, compile=False,
                     recipes=(mine,), recipes_from_model=False)
    assert step.recipe_of(0, 12, None) is mine
