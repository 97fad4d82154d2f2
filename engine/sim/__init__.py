"""The simulator: the real scheduler and block manager on a virtual clock, with the
paper's baseline allocators (`baselines/`) to compare against.

Torch-free, like the engine core it drives (tests/engine/test_layout.py checks)."""
