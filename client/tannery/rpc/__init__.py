"""What every call is made of, below the data plane and the call core: the gRPC connection
(channel, TLS, the mapping of gRPC errors to tannery's), the request messages, the steps a
call yields for a client to run (:mod:`.waits`) and when a failed call is tried again.
Nothing here moves a tensor's bytes."""
