"""The channel fabric: what carries channel payloads between replicas, chosen by URL.

A :class:`Fabric` is all the Channels servicer knows of other replicas:

- :meth:`Fabric.join` before a subscriber is registered (it returns once payloads published
  anywhere from then on will reach this server) and :meth:`Fabric.leave` when it is gone;
- :meth:`Fabric.check` before a publisher is attached (a Failure when the fabric is down);
- :attr:`Fabric.exporter`, given to the hub, which hands every piece its publishers relay to
  the fabric (:class:`~.hub.Outbound`); payloads from other replicas come back through the
  hub as relays of their own;
- :meth:`Fabric.announce` of an alias moved here, and :attr:`Fabric.alias_moved`, called with
  the aliases moved on other replicas (the Watch call hears of a move at once, not a poll later:
  :mod:`.watching`).

:func:`open_fabric` is the one place that reads ``Config.nats``: empty gives the
:class:`LocalFabric` (channels in this server's memory, as without replicas; nats is never
imported), ``nats://`` (or ``tls://``) URLs give :class:`~.nats_fabric.NatsFabric`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from .config import Config
from .hub import Exporter, Hub, Piece


class Fabric(Protocol):
    """What joins the channels of several replicas (see the module's docstring)."""

    #: The hub's exporter (None: payloads stay on this server).
    exporter: Exporter | None
    #: Called with each alias another replica announces (None: nobody listens here).
    alias_moved: Callable[[str], None] | None

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def check(self) -> None:
        """Raise a Failure (UNAVAILABLE) naming the fabric when it cannot carry payloads now."""

    async def join(self, channel: str) -> None:
        """Take interest in ``channel``: returns once its payloads published from now on reach this server."""

    def leave(self, channel: str) -> None:
        """One subscriber fewer of ``channel`` here (after a successful :meth:`join`)."""

    def announce(self, alias: str) -> None:
        """Tell the other replicas that ``alias`` moved (best effort: their poll is the fallback)."""

    def stats(self) -> dict[str, Any]:
        """Numbers for the metrics (empty for none)."""


class LocalFabric:
    """No other replicas: every call is a no-op and nothing is exported."""

    exporter = None
    alias_moved = None

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def check(self) -> None:
        pass

    async def join(self, channel: str) -> None:
        pass

    def leave(self, channel: str) -> None:
        pass

    def announce(self, alias: str) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}


def open_fabric(config: Config, hub: Hub, pieces: Callable[[bytes], list[Piece]],
                data_of: Callable[[object], Any]) -> Fabric:
    """The fabric ``config.nats`` names; ``pieces`` makes a subscriber's messages of payload bytes
    from elsewhere, ``data_of`` gives the payload bytes a relayed message carries."""
    if not config.nats:
        return LocalFabric()
    from .nats_fabric import NatsFabric  # nats-py is imported only when asked for

    return NatsFabric(config, hub, pieces, data_of)
