"""Shared pytest fixtures for the flexpage test suite."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> pathlib.Path:
    """Folder of the converted default model (SmolLM2-135M-Instruct).

    Converting the packaged GGUF takes ~30 s, so it happens at most once per
    session (and once per machine: the result lives in the flexpage cache,
    ``$FLEXPAGE_CACHE`` or ``~/.cache/flexpage/models``).
    """
    from flexpage.model.loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="module")
def compile_budget():
    """Room for every compiled FlexAttention variant a test module builds, and no silent fallback.

    ``torch.compile`` gives one function 8 compiled variants by default and then quietly
    runs it *eagerly*; the attention test modules build more than that (dtypes x head dims
    x recipes x decode/prefill), so they raise the limit and make hitting it an error:
    a test named "compiled" must really run the compiled kernel.
    """
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=128, fail_on_recompile_limit_hit=True):
        yield


# --------------------------------------------------------------------------- engine tests
# Fixtures for tests/test_engine.py, tests/test_llm_api.py and tests/test_cli.py.


@pytest.fixture(scope="module")
def single_torch_thread():
    """Run a module's tests with one intra-op torch thread (``$FLEXPAGE_TEST_THREADS`` overrides).

    On a small shared CPU a second intra-op thread mostly spins waiting for a core: the
    engine tests measured 5-10x faster with one thread while other jobs were running.
    """
    import os

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("FLEXPAGE_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_model_path):
    """``tiny_model(kind, **overrides)`` -> folder of a tiny random-weight HF checkpoint.

    ``kind`` is one of ``tests/engine_models.py``'s architectures (llama, mistral, gemma2,
    qwen2, qwen3, bloom); each distinct call is built once per session.
    """
    from engine_models import build_tiny_model

    built: dict[tuple, pathlib.Path] = {}

    def get(kind: str, **overrides) -> pathlib.Path:
        key = (kind, tuple(sorted(overrides.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            built[key] = build_tiny_model(kind, folder, default_model_path, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def llm_factory():
    """``llm_factory(model, **engine_config)`` -> an ``LLM`` shared by every caller with the same arguments.

    Defaults for tests: ``dtype="float32"``, ``compile=False`` (eager attention: no compile
    wait, and tiny models run fast enough) and ``num_blocks=64`` (never the 1 GiB default
    pool). Every engine built here is checked by ``kv_blocks_returned``.
    """
    from flexpage import LLM

    engines: dict[tuple, LLM] = {}

    def get(model, **config) -> LLM:
        config = {"dtype": "float32", "compile": False, "num_blocks": 64, **config}
        frozen = {name: tuple(sorted(value.items())) if isinstance(value, dict) else value
                  for name, value in config.items()}
        key = (str(model) if model is not None else None, tuple(sorted(frozen.items())))
        if key not in engines:
            engines[key] = LLM(str(model) if model is not None else None, **config)
        return engines[key]

    get.engines = engines  # type: ignore[attr-defined]
    return get


@pytest.fixture
def kv_blocks_returned(llm_factory):
    """After the test: every shared engine is idle and every KV block is back in the pool.

    "Back" means free or prefix-cached (ref count 0): ``used == 0`` on the device and no
    host (swap) blocks held. A violation fails the test's teardown; the engine is then
    cleaned (requests aborted) so that later tests are not blamed for it.
    """
    yield
    problems = []
    for key, llm in llm_factory.engines.items():
        engine = llm.engine
        stats = engine.block_manager.stats()
        leftovers = sorted(engine.requests)
        if leftovers or engine.scheduler.has_unfinished() or stats.used or stats.host_used:
            problems.append(f"{key}: requests {leftovers}, running {len(engine.scheduler.running)}, waiting "
                            f"{len(engine.scheduler.waiting)}, swapped {len(engine.scheduler.swapped)}, "
                            f"blocks used {stats.used}, host blocks used {stats.host_used}")
            for request_id in leftovers:
                engine.abort(request_id)
            for queue in (engine.scheduler.running, engine.scheduler.waiting, engine.scheduler.swapped):
                for seq in list(queue):
                    engine.scheduler.abort(seq.seq_id)
    if problems:
        pytest.fail("KV blocks not returned to the pool:\n" + "\n".join(problems))
