"""The IO shell: asyncio actors over ZeroMQ + msgpack, one engine object each."""
