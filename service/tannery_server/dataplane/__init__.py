"""The server's data plane: every way a payload's bytes move between a call and the storage.

The gRPC streams, the same-host socket and the TCP data port all end here: the listeners
and their tickets (:mod:`.listeners`), the one verified reader of stored blocks
(:mod:`.blocks`), and the send and receive of each transport. The servicers ask the
:class:`~.plane.DataPlane` to serve a Fetch or receive a Store, whatever the transport.
"""
