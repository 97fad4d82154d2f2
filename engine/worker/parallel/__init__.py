"""Tensor parallelism: a process group of ranks, each holding a slice of every
weight matrix, and the layers that split a matmul across them (Megatron-LM's
column- and row-parallel linears, vocab-parallel embedding and LM head)."""
