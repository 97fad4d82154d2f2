"""The KV cache's block tables: block pool, prefix hashes, the `BlockTables` interface,
the paged tables, block ops, the scheduler's ledger and the block manager's tables (the
paper's baseline allocators live with the simulator, engine/sim/baselines/).

Pure logic: never imports torch (tests/engine/test_layout.py checks)."""
