"""The worker: model runner, input batch, KV tensors, sampler, logprobs, loader,
attention backends and models. The only part of engine/ that imports torch; the plan
protocol itself (`worker.py`, `worker_request.py`, `model_output.py`) is torch-free, so
the simulator's model-free workers run it without torch."""
