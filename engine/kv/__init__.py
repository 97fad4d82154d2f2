"""The KV cache's block tables: block pool, prefix hashes, block ops, the scheduler's
ledger and the block manager's tables.

Pure logic: never imports torch (tests/engine/test_layout.py checks)."""
