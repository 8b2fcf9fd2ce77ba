"""tannery's gRPC server: the Archives checkpoint store and the Channels relay.

Run it with ``tannery serve`` or ``python -m tannery_server serve``. It never imports
torch: it reads payloads through the torch-free :mod:`tannery_protocol.codec`.
"""

__version__ = "0.1.0"
