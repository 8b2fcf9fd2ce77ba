"""How a Store, Fetch, Publish and Subscribe move their bytes: the transports (gRPC streams,
sealed memory files on one host, TCP links), the readers that turn payloads into tensors, and
the memory they are received into. Uses :mod:`tannery.rpc`; the call core above chooses."""
