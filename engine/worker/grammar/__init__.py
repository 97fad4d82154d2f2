"""Structured outputs at sampling: grammars compiled from `StructuredOutputsParams`, one
matcher per sequence, and each step's token bitmask.

`backend.py` is the seam (a `GrammarBackend` Protocol; xgrammar is the one backend
today, in `xgrammar_backend.py`); `compile_cache.py` keeps compiled grammars;
`matchers.py` gives the worker its per-sequence matchers; `step_bitmask.py` turns a
step's matchers into the mask the sampler applies; `checker.py` is what the text
processor injects to refuse a constraint that does not compile before it is scheduled.
Importing this package imports neither torch nor xgrammar: only building a backend does.
"""
