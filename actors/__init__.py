"""The IO shell: asyncio actors over ZeroMQ + msgpack (in-process queues where two share
a loop), one engine object each; one engine's actors wired once (`engine_graph`) beside
its worker processes (`engine_start`, `worker_launch`), watched (`supervisor`), and the
engine clients web/ talks to (`engine_client.EngineClient`: `AsyncEngine`,
`RestartingEngine`, `ReplicaSet`)."""
