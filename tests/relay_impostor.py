"""A member of a channel's relay plan whose relay port refuses the key it told the server (as a
follower restarted with a new key would, or a port taken by another process): the followers
routed through it are refused. Run in a namespace by tests/test_relays.py:

    python -m tests.relay_impostor TARGET CHANNEL

It prints ``{"ready": true}`` once it has its first route, then holds its place until killed.
"""

from __future__ import annotations

import json
import os
import sys
import uuid

import tannery
from tannery.dataplane.relay_port import RelayPort
from tannery.weights.relays import _host_toward
from tannery_protocol.v1 import channels_pb2


def main() -> None:
    target, channel = sys.argv[1:3]
    with tannery.Client(target) as client:
        host = _host_toward(target)
        port = RelayPort(host, 0, key=os.urandom(32))  # not the key it tells the server
        request = channels_pb2.RouteRequest(channel=channel, address=f"{host}:{port.port}", key=os.urandom(32),
                                            member=uuid.uuid4().hex)
        for update in client._calls.methods.route(request):
            print(json.dumps({"ready": True, "parent": update.parent}), flush=True)


if __name__ == "__main__":
    main()
