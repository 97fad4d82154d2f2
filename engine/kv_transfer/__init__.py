"""KV transfer between instances (prefill/decode disaggregation): the pure half.

A prefill instance (role `kv_producer`) computes a prompt, saves its KV blocks and hands
back `kv_transfer_params` saying where they are; a decode instance (`kv_consumer`)
allocates blocks of its own and loads them. The sockets live in `actors/`
(`actors.kv_transfer_connector`); here is what they move and the contract they keep:

- `config`: `KVTransferConfig`, parsed from vLLM's `--kv-transfer-config` JSON.
- `params`: `KVTransferParams`, vLLM's `kv_transfer_params` dict as a checked dataclass.
- `payload`: `BlocksHeader` + `KVPayload`, the wire form of a run of blocks (torch-free).
- `blocks`: `gather_blocks` / `scatter_blocks` between a paged cache and a payload.
- `held_blocks`: `HeldBlocks`, the producer's saved blocks until fetched or expired.
- `connector`: the `KVConnector` Protocol and `LoadResult`.
- `endpoint`: `KVEndpoint`, the cache-side work every connector shares.
- `in_memory`: `InMemoryConnector`, a connector without sockets (tests, one process).
- `wire`: the fetch messages a consumer and a producer exchange.

Only `blocks` (and what builds on it: `endpoint`, `in_memory`) imports torch.
"""
