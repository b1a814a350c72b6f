"""Device backends: everything that knows a device kind or edits torch's private internals.

``attention/``, ``core/`` and the engine stay device-independent; what depends on the CPU
(its ISA, oneDNN, Inductor's C++ templates, the C++ kernels flexpage builds) lives in
:mod:`flexpage.backends.cpu`. A CUDA backend would sit beside it.
"""
