"""flexpage: PagedAttention as FlexAttention programs, and an LLM engine and server on top.

``import flexpage`` registers ``attn_implementation="flexpage"`` with HF transformers, and
unless ``$TORCHINDUCTOR_CACHE_DIR`` is set, points it at ``~/.cache/flexpage/inductor``:
Inductor's default is a temp directory that a reboot clears, and a second start should load
its compiled graphs (SmolLM2's warm-up: ~10 s instead of ~100 s on 2 cores). It must happen
before anything calls ``torch.compile``, which fixes the directory (flexpage's own modules do
at import). A process that compiled before importing flexpage keeps its directory.
"""

import os as _os

#: where compiled kernels are kept unless ``$TORCHINDUCTOR_CACHE_DIR`` names another place
COMPILE_CACHE_DIR = _os.path.join(_os.path.expanduser("~"), ".cache", "flexpage", "inductor")
_os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", COMPILE_CACHE_DIR)

from flexpage.model.hf_backend import register as _register_hf_backend  # noqa: E402

_register_hf_backend()

__version__ = "0.1.0"

from flexpage.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence  # noqa: E402
from flexpage.llm import LLM  # noqa: E402
from flexpage.outputs import CompletionOutput, RequestOutput  # noqa: E402
from flexpage.sampling_params import SamplingParams  # noqa: E402
from flexpage.structured import StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
