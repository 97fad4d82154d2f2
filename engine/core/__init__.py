"""The engine core: scheduler, requests and groups, beams, step plans, stats.

Pure logic: never imports torch (tests/engine/test_layout.py checks)."""
