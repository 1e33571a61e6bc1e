"""A fair share of a worker's receive slots for every client: `Shares`, the slots a call needs while its message
arrives and the calls waiting for one, shared max-min fairly between peer addresses and, within an address,
between its connections.

A client that holds slots without finishing its messages (a slow-loris for gRPC: streams kept open with empty DATA
frames) would otherwise keep every slot, and every place in the queue for one, from everyone else. Here a call
that finds no slot free takes one from the peer that holds the most, if that peer holds more than its own: first
by address (another address holding more slots than the caller's), then by connection within the caller's
address (so a client sharing its address with the attacker, behind a NAT or on the same host, is still served).
The call taken from is the oldest of that connection's, the one likeliest stalled. The same rule bounds the calls
that wait for a slot. A slot given back goes to the waiting call whose address, then connection, holds the fewest.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable

HOLDING, PARKED, REFUSED, DONE = "holding", "parked", "refused", "done"


class Claim:
    """One call's claim on a slot. `granted` runs once a waiting claim gets a slot; `cut` once the claim is taken
    from for a fairer share (both outside the lock, on the thread that caused it)."""
    __slots__ = ("address", "connection", "granted", "cut", "state", "shares")

    def __init__(self, address: str, connection: str, granted: Callable[[], object] | None = None,
                 cut: Callable[[], object] | None = None) -> None:
        self.address, self.connection, self.granted, self.cut = address, connection, granted, cut
        self.state = DONE
        self.shares: Shares | None = None

    def release(self) -> None:
        """Give the slot back, or stop waiting for one; once (a claim cut gives nothing back: its slot moved on)."""
        if self.shares is not None:
            self.shares.release(self)


def peer_of(peer: str) -> tuple[str, str]:
    """(address, connection) of grpc's peer string: "ipv4:10.0.0.7:51234" is the address "ipv4:10.0.0.7" and the
    connection "ipv4:10.0.0.7:51234". A peer without a port (a Unix socket's) is one address and one connection."""
    address, sep, port = peer.rpartition(":")
    return (address, peer) if sep and port.isdigit() else (peer, peer)


class Shares:
    """`slots` receive slots and at most `waiting` calls waiting for one."""

    def __init__(self, slots: int, waiting: int) -> None:
        self.lock = threading.Lock()
        self.slots = self.free = slots
        self.waiting = waiting
        self.holding: dict[Claim, None] = {}  # oldest first
        self.parked: dict[Claim, None] = {}  # oldest first

    def claim(self, claim: Claim, park: bool = True) -> str:
        """HOLDING (a slot, free or taken from a peer holding more), PARKED (waiting; only with `park`) or REFUSED
        (no slot and no room to wait, from no peer holding more)."""
        cut = taken = None
        with self.lock:
            claim.shares = self
            if self.free > 0:
                self.free -= 1
                state = HOLDING
            elif (cut := victim(self.holding, claim)) is not None:
                del self.holding[cut]
                state = HOLDING
            elif not park:
                state = REFUSED
            elif len(self.parked) < self.waiting:
                state = PARKED
            elif (cut := victim(self.parked, claim)) is not None:
                del self.parked[cut]
                state = PARKED
            else:
                state = REFUSED
            claim.state = state
            if state == HOLDING:
                self.holding[claim] = None
            elif state == PARKED:
                self.parked[claim] = None
            if cut is not None:
                cut.state = DONE
                taken, cut.granted, cut.cut = cut.cut, None, None
        if taken is not None:
            taken()
        return state

    def release(self, claim: Claim) -> None:
        granted = None
        with self.lock:
            if claim.state == HOLDING:
                del self.holding[claim]
                if self.parked:
                    granted = next_in_line(self.parked, self.holding)
                    del self.parked[granted]
                    granted.state = HOLDING
                    self.holding[granted] = None
                else:
                    self.free += 1
            elif claim.state == PARKED:
                del self.parked[claim]
            claim.state = DONE
            claim.granted = claim.cut = None  # the call's own methods: kept, its call would wait for the cyclic GC
        if granted is not None and granted.granted is not None:
            granted.granted()


def victim(claims: dict[Claim, None], mine: Claim) -> Claim | None:
    """The claim to take for `mine`, or None: the oldest of the connection that holds the most, within the address
    that holds the most when that holds more than `mine`'s, else within `mine`'s address when a connection there
    holds more than `mine`'s."""
    addresses = Counter(claim.address for claim in claims)
    if not addresses:
        return None
    top = max(addresses, key=addresses.__getitem__)  # ties: the address whose oldest claim is oldest
    within = top if addresses[top] > addresses[mine.address] else mine.address
    scope = [claim for claim in claims if claim.address == within]
    connections = Counter(claim.connection for claim in scope)
    heaviest = max(connections, key=connections.__getitem__, default=None)
    if heaviest is None or (within == mine.address and connections[heaviest] <= connections[mine.connection]):
        return None
    return next(claim for claim in scope if claim.connection == heaviest)


def next_in_line(parked: dict[Claim, None], holding: Iterable[Claim]) -> Claim:
    """The waiting claim whose address, then connection, holds the fewest slots; the oldest of those."""
    held = list(holding)
    addresses = Counter(claim.address for claim in held)
    connections = Counter(claim.connection for claim in held)
    return min(parked, key=lambda claim: (addresses[claim.address], connections[claim.connection]))
