"""KV budgets through the engine: after an eviction every token's logits equal a dense
reference attending only to the kept tokens, at their original positions.

The reference is HF transformers' own forward over the whole text (fp32) with a 4D mask:
the query at position ``t`` sees the keys the engine still held when it computed ``t``
(recorded after every step), within the model's sliding window. Eviction policies are
scored on real keys and values here; which blocks go is tested exactly in
``test_kv_budget_blocks.py``.
"""

from __future__ import annotations

import pytest
import torch
from engine_models import load_reference, random_prompts

from flexpage import SamplingParams
from flexpage.attention.eviction import EvictionPolicy
from flexpage.model.kv_eviction import EVICTION_POLICIES, resolve_eviction_policy

pytestmark = pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")

BLOCK = 8  # the engine's default block size
PROMPT_LEN = 70
NEW_TOKENS = 20
BUDGET = 3 * BLOCK
WIDE_WINDOW = 40  # a sliding window wider than the budget: eviction, not the window, prunes


def greedy(budget: int | None, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, kv_budget=budget, **kwargs)


def run_recording_kept_blocks(engine, prompt: list[int], params: SamplingParams) -> tuple[list, list[list[int]]]:
    """Run one request step by step; returns (its output, the logical blocks it held before each step)."""
    request_id = engine.add_request({"prompt_token_ids": prompt}, params)
    seq = engine.requests[request_id].seqs[0]
    held_before_step: list[list[int]] = []
    final = None
    while final is None or not final.finished:
        held_before_step.append([i for i, b in enumerate(engine.block_manager.block_table(seq)) if b])
        for out in engine.step():
            if out.request_id == request_id:
                final = out
    return final, held_before_step


def reference_mask(prompt_len: int, total: int, held_before_step: list[list[int]], window: int | None) -> torch.Tensor:
    """[1, 1, T, T] additive mask: causal; the prompt sees all of itself (one prefill step); the
    token at position ``t >= prompt_len`` sees the blocks held when it was computed, and its own."""
    allowed = torch.ones(total, total).tril().bool()
    # step 0 is the prefill; decode step k computes position prompt_len - 1 + k
    for k, held in enumerate(held_before_step[1:], 1):
        t = prompt_len - 1 + k
        if t >= total:
            break
        visible = torch.zeros(total, dtype=torch.bool)
        for i in held:
            visible[i * BLOCK:(i + 1) * BLOCK] = True
        visible[t // BLOCK * BLOCK:] = True  # the newest block: it may have been allocated by this step
        allowed[t] &= visible
    if window is not None:
        pos = torch.arange(total)
        allowed &= (pos[:, None] - pos[None, :]) < window
    return torch.zeros(total, total).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


@torch.no_grad()
def reference_logprobs(folder, ids: list[int], mask: torch.Tensor) -> torch.Tensor:
    logits = load_reference(folder)(torch.tensor([ids]), attention_mask=mask).logits[0].float()
    return logits.log_softmax(-1)


@pytest.mark.parametrize("kind, policy, compiled", [
    ("llama", "paged_eviction", False),
    ("llama", "paged_eviction", True),
    ("llama", "streaming_llm", False),
    ("llama", "key_norm", False),
    ("mistral", "paged_eviction", False),
])
def test_logits_after_eviction_equal_a_dense_reference_over_the_kept_tokens(kind, policy, compiled, tiny_model,
                                                                              llm_factory):
    window = WIDE_WINDOW if kind == "mistral" else None
    folder = tiny_model(kind, sliding_window=window) if window else tiny_model(kind)
    config = {"compile": True, "num_blocks": 128} if compiled else {}
    engine = llm_factory(folder, kv_eviction=policy, **config).engine
    [prompt] = random_prompts((PROMPT_LEN,), seed=3)
    out, held_before_step = run_recording_kept_blocks(engine, prompt, greedy(BUDGET, logprobs=0))
    tokens = out.outputs[0].token_ids
    assert out.metrics.evicted_blocks > 0 and out.metrics.evicted_tokens == out.metrics.evicted_blocks * BLOCK
    ids = prompt + tokens
    mask = reference_mask(len(prompt), len(ids) - 1, held_before_step, window)
    ref = reference_logprobs(folder, ids[:-1], mask)[len(prompt) - 1:]
    got = torch.tensor([entry[token].logprob for entry, token in zip(out.outputs[0].logprobs, tokens)])
    want = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert tokens == ref.argmax(-1).tolist()
    if window is None:  # the mask matters: the full-attention forward gives other logits
        full = reference_logprobs(folder, ids[:-1], reference_mask(len(prompt), len(ids) - 1, [], None))
        assert (full[len(prompt) - 1:][torch.arange(len(tokens)), torch.tensor(tokens)] - want).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["llama", "bloom", "gemma2"])
def test_a_budget_at_least_the_context_changes_nothing(kind, tiny_model, llm_factory):
    llm = llm_factory(tiny_model(kind))
    prompts = random_prompts((PROMPT_LEN, 9, 33), seed=5)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain = llm.generate(inputs, greedy(None))
    budgeted = llm.generate(inputs, greedy(PROMPT_LEN + NEW_TOKENS + BLOCK - (PROMPT_LEN + NEW_TOKENS) % BLOCK))
    assert [o.outputs[0].token_ids for o in budgeted] == [o.outputs[0].token_ids for o in plain]
    assert all(o.metrics.evicted_blocks == 0 for o in budgeted)


@pytest.mark.parametrize("kind", ["bloom", "gemma2"])
def test_alibi_and_hybrid_layer_models_evict_and_give_every_block_back(kind, tiny_model, llm_factory):
    llm = llm_factory(tiny_model(kind))
    outs = llm.generate([{"prompt_token_ids": p} for p in random_prompts((PROMPT_LEN, 40), seed=6)],
                        greedy(BUDGET))
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    assert outs[0].metrics.evicted_blocks > 0
    assert llm.engine.stats()["kv_evicted_blocks"] > 0


GROWING = dict(max_tokens=40, ignore_eos=True, kv_budget=6 * BLOCK)  # sequences grow past the budget while decoding


def test_swapped_out_and_back_a_pruned_sequence_continues_as_if_never_preempted(tiny_model, llm_factory):
    folder = tiny_model("llama")
    inputs = [{"prompt_token_ids": p} for p in random_prompts((20, 24, 28, 30), seed=7)]
    params = SamplingParams(temperature=0, **GROWING)
    roomy = llm_factory(folder).generate(inputs, params)
    tight = llm_factory(folder, num_blocks=16, preemption_mode="swap", swap_space="1MiB")
    outs = tight.generate(inputs, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert all(o.metrics.evicted_blocks > 0 for o in roomy)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]


def test_recompute_preemption_chunked_prefill_and_n_samples_with_a_budget(tiny_model, llm_factory):
    llm = llm_factory(tiny_model("llama"), num_blocks=16, max_num_batched_tokens=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in random_prompts((PROMPT_LEN, 24, 28), seed=8)],
                        SamplingParams(n=2, temperature=1.0, seed=1, **GROWING))
    assert all(len(c.token_ids) == 40 for o in outs for c in o.outputs)
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(o.metrics.evicted_blocks > 0 for o in outs)


@pytest.mark.parametrize("budget, message", [
    (20, "multiple of the block size"),
    (16, "at least 3 blocks"),
    (0, "kv_budget must be >= 1"),
    ("64", "kv_budget"),
])
def test_bad_budgets_are_rejected_before_anything_is_scheduled(budget, message, tiny_model, llm_factory):
    llm = llm_factory(tiny_model("llama"))
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(kv_budget=budget))
    assert not llm.engine.requests and not llm.engine.scheduler.has_unfinished()


def test_bad_engine_budgets_and_policies_are_refused():
    from flexpage.config import EngineConfig

    with pytest.raises(ValueError, match="kv_budget_tokens: got 20"):
        EngineConfig(kv_budget_tokens=20)
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(kv_budget_tokens=64, deterministic=True)
    with pytest.raises(ValueError, match="kv_eviction: got 'lru'"):
        resolve_eviction_policy("lru")


def test_every_named_policy_resolves_and_a_user_policy_loads_from_a_file(tmp_path):
    assert [resolve_eviction_policy(name).name for name in EVICTION_POLICIES] == list(EVICTION_POLICIES)
    file = tmp_path / "recent.py"
    file.write_text("from flexpage.attention.eviction import EvictionPolicy\n"
                    "recent = EvictionPolicy('recent', lambda k, v, pos: pos.float())\n")
    policy = resolve_eviction_policy(f"{file}:recent")
    assert isinstance(policy, EvictionPolicy) and policy.name == "recent"


def test_scores_read_the_blocks_keys_and_values():
    from flexpage.attention.kv_pool import KVPool
    from flexpage.model.kv_eviction import block_scores
    from flexpage.recipes.key_norm import key_norm
    from flexpage.recipes.paged_eviction import paged_eviction

    pool = KVPool(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=2)
    view = pool.storage.view(2, 2, 4, 2, 2)  # [layer, k/v, block, slot, dim]
    view[:, 0] = 1.0
    view[:, 1] = 1.0
    view[:, 0, 2] = 2.0  # block 2: keys twice as long
    scores = block_scores(pool, paged_eviction(), [[1, 2]], [0, 2])
    assert scores == pytest.approx([1.0, 0.5])
    assert block_scores(pool, key_norm(), [[1, 2]], [0, 2]) == pytest.approx([2 ** -0.5, 0.5 * 2 ** -0.5])
