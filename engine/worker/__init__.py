"""The worker: model runner, input batch, KV tensors, sampler, logprobs, loader,
attention backends and models. The only part of engine/ that imports torch."""
