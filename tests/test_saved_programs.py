"""Compiled programs kept on disk (:mod:`flexpage.backends.cpu.saved_programs`).

* A program compiled once is saved; a new :class:`SavedProgram` of the same key (what the next
  process builds) loads it and runs it without compiling, for any size marked dynamic, with
  the compiled function's results.
* A call its guards refuse (another dtype) compiles and saves one more program; a torn file
  is skipped with a warning, never a failed call.
* A call whose tensors match the last accepted call's (sizes, strides, dtype, ...) under the
  same global state runs that program without checking its guards again.
* A program whose graph only reads its inputs runs the graph directly, without Dynamo's
  prologue and AOTAutograd's wrappers around it, with the same results; one that writes to
  an input runs whole.
* Saved programs are read one at a time, the one that served a call last first, until one
  accepts the call (each costs a process ~0.4 s to read).
* Keys name content: equal constants give equal fingerprints, a changed closure value or
  tensor gives another, and a value it cannot name is a TypeError (never a shared program).

The engine-level round trip (a GGUF model's compiled step saved by one engine and loaded by
the next, same greedy tokens) is in ``test_gguf_linear.py``, beside its model.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from flexpage.backends.cpu import saved_programs
from flexpage.backends.cpu.saved_programs import SavedProgram, fingerprint, prune, saveable_guards


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w) + 1.0


def _run(program: SavedProgram, rows: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = torch.randn(rows, 8, dtype=dtype), torch.randn(8, 4, dtype=dtype)
    with torch.inference_mode():
        return program((x, w), [(x, 0)]), _step(x, w)


def test_a_saved_program_is_loaded_by_the_next_instance_and_runs_every_row_count(tmp_path):
    first = SavedProgram(_step, "k", tmp_path)
    out, expected = _run(first, 5)
    assert torch.allclose(out, expected)
    assert (first.compiled_here, first.loaded, len(list(tmp_path.glob("k-*.bin")))) == (1, 0, 1)

    second = SavedProgram(_step, "k", tmp_path)  # as in a new process
    for rows in (5, 3, 40):
        out, expected = _run(second, rows)
        assert torch.allclose(out, expected)
    assert (second.compiled_here, second.loaded) == (0, 1)


def test_a_call_no_saved_program_accepts_compiles_one_more(tmp_path):
    _run(SavedProgram(_step, "k", tmp_path), 5)
    program = SavedProgram(_step, "k", tmp_path)
    out, expected = _run(program, 6, torch.float64)  # a dtype guard fails
    assert torch.allclose(out, expected)
    assert (program.compiled_here, program.loaded, len(list(tmp_path.glob("k-*.bin")))) == (1, 1, 2)


def test_saved_programs_are_read_only_until_one_accepts_the_call_most_recently_used_first(tmp_path):
    _run(SavedProgram(_step, "k", tmp_path), 5)
    _run(SavedProgram(_step, "k", tmp_path), 5, torch.float64)  # saved last: read first
    program = SavedProgram(_step, "k", tmp_path)
    _run(program, 5)
    assert (program.compiled_here, program.loaded) == (0, 2)
    program = SavedProgram(_step, "k", tmp_path)  # the float32 program served a call last
    _run(program, 5)
    assert (program.compiled_here, program.loaded) == (0, 1)


def test_a_torn_file_is_skipped_with_a_warning(tmp_path, caplog):
    _run(SavedProgram(_step, "k", tmp_path), 5)
    (tmp_path / "k-torn.bin").write_bytes(b"\x80\x04 not a whole program")
    program = SavedProgram(_step, "k", tmp_path)
    with caplog.at_level(logging.WARNING, logger="flexpage.backends.cpu.saved_programs"):
        out, expected = _run(program, 7)
    assert torch.allclose(out, expected)
    assert (program.compiled_here, program.loaded) == (0, 1)
    assert "k-torn.bin" in caplog.text


def test_pruning_drops_the_least_recently_used_programs_until_the_rest_fit(tmp_path):
    for when, name in enumerate(["a.bin", "b.bin", "c.bin"], start=1):  # a: used longest ago
        (tmp_path / name).write_bytes(bytes(100))
        os.utime(tmp_path / name, (1000.0 * when, 1000.0 * when))
    prune(tmp_path, 200)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "c.bin"]
    prune(tmp_path, 0, keep=tmp_path / "b.bin")
    assert [p.name for p in tmp_path.iterdir()] == ["b.bin"]


def test_a_save_bounds_the_folder(tmp_path, monkeypatch):
    """Each flexpage or torch version keys new programs: the old ones must not pile up."""
    (tmp_path / "another-version.bin").write_bytes(bytes(100))
    monkeypatch.setattr(saved_programs, "PROGRAM_FOLDER_BYTES", 0)
    _run(SavedProgram(_step, "k", tmp_path), 5)
    assert [p.name.startswith("k-") for p in tmp_path.iterdir()] == [True]


def test_a_call_like_the_last_accepted_one_skips_the_guard_check(tmp_path):
    """Same tensor metadata and global state as the last call a program accepted: no guard
    check. Another size, another grad mode or shared memory between arguments: a check."""
    program = SavedProgram(_step, "k", tmp_path)
    _run(program, 5)
    checks = []
    [saved] = program.programs
    real_check = saved.guard_check
    saved.guard_check = lambda *args: checks.append(args) or real_check(*args)
    _run(program, 5)  # new tensors, same metadata
    assert checks == []
    _run(program, 6)
    assert len(checks) == 1
    x, w = torch.randn(6, 8), torch.randn(8, 4)
    with torch.inference_mode():
        program((x, w), [(x, 0)])  # like the last call
    assert len(checks) == 1
    out = program((x, w), [(x, 0)])  # outside inference mode: the global state differs
    assert len(checks) == 2 and out.shape == (6, 4)
    square = torch.randn(8, 8)
    program((square[:6], square), [])  # the two arguments share memory: checked again
    assert len(checks) == 3


def _add_into(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x.add_(w)
    return x * 2.0


def test_a_graph_that_only_reads_its_inputs_is_called_directly(tmp_path):
    for attempt in ("compiled here", "loaded"):
        program = SavedProgram(_step, "k", tmp_path)
        for rows in (5, 9, 5):
            out, expected = _run(program, rows)
            assert torch.allclose(out, expected), attempt
        assert (program.compiled_here, program.loaded) == ((1, 0) if attempt == "compiled here" else (0, 1))
        assert program.calls_graphs_directly, attempt


def test_a_graph_that_writes_to_an_input_runs_whole(tmp_path):
    program = SavedProgram(_add_into, "k", tmp_path)
    for rows in (5, 7):
        x, w = torch.randn(rows, 4), torch.randn(rows, 4)
        expected = (x + w) * 2.0
        with torch.inference_mode():
            out = program((x, w), [(x, 0), (w, 0)])
        assert torch.allclose(out, expected) and torch.allclose(x, expected / 2.0)  # written once per call
    assert not program.calls_graphs_directly and program._runners


def test_saved_programs_keep_the_guards_they_can_save_less_those_on_unguarded_arguments():
    def guard(name: str, guard_type: str = "TENSOR_MATCH", is_global: bool = False) -> SimpleNamespace:
        return SimpleNamespace(name=name, guard_type=guard_type, is_global=is_global)

    guards = [guard("x"), guard("weights"), guard("weights[3][1]"), guard("weights_other"),
              guard("torch", "ID_MATCH", is_global=True), guard("fn", "CLOSURE_MATCH")]
    assert saveable_guards(("weights",), guards) == [True, False, False, True, False, False]


def _window_mask(window: int):
    def mask(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return q - kv < window

    return mask


def test_fingerprints_name_content():
    assert fingerprint((_window_mask(4), {"a": 1.0})) == fingerprint((_window_mask(4), {"a": 1.0}))
    assert fingerprint(_window_mask(4)) != fingerprint(_window_mask(5))  # a closure value
    assert fingerprint(torch.tensor([1.0, 2.0])) != fingerprint(torch.tensor([1.0, 3.0]))
    assert fingerprint(torch.tensor(2.0)) != fingerprint(torch.tensor(3.0))
    assert fingerprint(torch.float32) != fingerprint(torch.bfloat16)
    with pytest.raises(TypeError, match="cannot fingerprint a object"):
        fingerprint(object())
