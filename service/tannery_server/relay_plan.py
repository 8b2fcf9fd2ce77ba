"""The relay plan of each channel: which member passes payloads on to which (the ``Route`` RPC).

Followers that relay join a channel's plan (``Channels.Route``): a list of slots, filled in the
order they join. The plan lays a tree of fan-out ``f`` over the slots: the server feeds the
first ``f`` members (by their Subscribe), and member ``j`` feeds the members of slots
``f (j + 1)`` to ``f (j + 1) + f - 1``. With ``f = 1`` (the default) it is a chain, each member
receiving and sending a version once: the server's egress is one model per version, whatever
the number of members, and each link carries it once (docs/weight-sync.md, "Relays").

The plan changes as little as it can: in a chain, the member after one that leaves takes its
grandparent; in a tree, the last member takes the slot left (only the members whose parent
changed are told); a member reported unreachable by its child goes to the last slot, a leaf. Every member is told its parent again whenever it changes,
on its own Route call; what a member misses while it moves (a version cut off) it takes from
the store, so the plan only decides how fast versions arrive, never whether they are whole.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from tannery_protocol.v1 import channels_pb2

from .failures import Malformed

#: The server's default fan-out: a chain.
DEFAULT_FANOUT = 1
#: What a member's queue gets when the server stops: its Route call ends UNAVAILABLE.
CLOSING = object()
#: Seconds a member whose Route call ended keeps its slot: a member that calls again at once (to
#: report its parent) takes it back, its children staying where they are.
LEAVE_GRACE_SECONDS = 1.0


@dataclass(eq=False)
class Member:
    """One follower in a channel's plan: where it relays, its key, and the queue of its Route call."""

    id: str
    address: str
    key: bytes
    #: The PEM certificate its relay port serves TLS with (empty: plain TCP).
    certificate: bytes = b""
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    #: The member this one takes payloads from (None: the server), as last told.
    told: tuple[Member | None, int] | None = None


class ChannelPlan:
    """The slots of one channel and the tree laid over them."""

    def __init__(self, fanout: int) -> None:
        self.fanout = fanout
        self.slots: list[Member] = []

    def parent_of(self, index: int) -> Member | None:
        """The member slot ``index`` takes its payloads from (None: the server)."""
        return None if index < self.fanout else self.slots[index // self.fanout - 1]

    def children_of(self, index: int) -> int:
        first = self.fanout * (index + 1)
        return max(0, min(len(self.slots), first + self.fanout) - first)

    def find(self, member_id: str) -> int | None:
        return next((index for index, member in enumerate(self.slots) if member.id == member_id), None)

    def find_address(self, address: str) -> int | None:
        return next((index for index, member in enumerate(self.slots) if member.address == address), None)

    def remove(self, index: int) -> Member:
        """Take the member out of slot ``index``: a chain closes over the gap (the next member takes
        its grandparent; no other moves), a tree puts its last member there (its children take it)."""
        if self.fanout == 1:
            return self.slots.pop(index)
        member = self.slots[index]
        last = self.slots.pop()
        if last is not member:
            self.slots[index] = last
        return member


class RoutePlanner:
    """The plans of every channel of this server, kept on its event loop."""

    def __init__(self, fanout: int = DEFAULT_FANOUT) -> None:
        if fanout < 1:
            raise ValueError(f"relay fan-out must be 1 or more, not {fanout}")
        self.fanout = fanout
        self.plans: dict[str, ChannelPlan] = {}
        self._generation = itertools.count(1)
        self.closed = False

    def join(self, channel: str, member: Member, unreachable: str = "") -> Member | None:
        """Put ``member`` in the plan of ``channel`` (in the slot of a member of the same id, which
        it replaces: returned, to end its older call), move the member it reports ``unreachable``
        to the end (its own parent, or itself when it fell behind: no member moves another), and
        tell every member whose route changed."""
        plan = self.plans.setdefault(channel, ChannelPlan(self.fanout))
        replaced = None
        index = plan.find(member.id)
        if index is not None:
            replaced, plan.slots[index] = plan.slots[index], member
        else:
            plan.slots.append(member)
        bad = plan.find_address(unreachable) if unreachable else None
        if bad is not None and (plan.slots[bad] is member or plan.parent_of(plan.slots.index(member)) is plan.slots[bad]):
            plan.slots.append(plan.remove(bad))  # to the end, a leaf (the caller itself, when it fell behind)
        self._tell(plan)
        return replaced

    def leave(self, channel: str, member: Member) -> None:
        """Take ``member`` out of the plan (its call ended), if it is still the one in its slot."""
        plan = self.plans.get(channel)
        if plan is None:
            return
        index = next((index for index, each in enumerate(plan.slots) if each is member), None)
        if index is None:
            return
        plan.remove(index)
        if plan.slots:
            self._tell(plan)
        else:
            del self.plans[channel]

    def close(self) -> None:
        """End every member's Route call (the server is stopping): each gets ``CLOSING``."""
        self.closed = True
        for plan in self.plans.values():
            for member in plan.slots:
                member.updates.put_nowait(CLOSING)

    def members(self, channel: str) -> int:
        plan = self.plans.get(channel)
        return len(plan.slots) if plan is not None else 0

    def _tell(self, plan: ChannelPlan) -> None:
        """Queue a RouteUpdate for each member whose parent or number of children changed."""
        generation = next(self._generation)
        for index, member in enumerate(plan.slots):
            route = (plan.parent_of(index), plan.children_of(index))
            if member.told == route:
                continue
            member.told = route
            parent, children = route
            member.updates.put_nowait(channels_pb2.RouteUpdate(
                parent=parent.address if parent is not None else "", parent_key=parent.key if parent is not None else b"",
                parent_certificate=parent.certificate if parent is not None else b"", children=children,
                generation=generation, address=member.address))


def relay_address(asked: str, peer: str) -> str:
    """Where a member's relay port is reached: ``asked`` ("host:port"), or for ":port" the host
    the member's call comes from (``peer``, as gRPC gives it: "ipv4:10.0.0.2:5123", "ipv6:[::1]:5123")."""
    host, _, port = asked.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise Malformed(f"relay address {asked!r} is not host:port or :port")
    if host:
        return asked
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        raise Malformed(f"relay address {asked!r} names no host, and this call comes from {peer!r}: name the host")
    return f"{rest.rpartition(':')[0]}:{port}"


__all__ = ["CLOSING", "ChannelPlan", "DEFAULT_FANOUT", "LEAVE_GRACE_SECONDS", "Member", "RoutePlanner", "relay_address"]
