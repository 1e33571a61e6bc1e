"""The gRPC port's fair shares of receive slots (serving/protocols/grpc_api/shares.py), in milliseconds: a call
that finds no slot takes one from the peer address, then the connection within its own address, that holds the
most, if that holds more than its own; otherwise it waits, or is refused once the places to wait are taken; a slot
given back goes to the waiting call whose address, then connection, holds the fewest."""
from __future__ import annotations

from serving.protocols.grpc_api.shares import HOLDING, PARKED, REFUSED, Claim, Shares, peer_of


class Call:
    """A claim that notes whether it was granted a slot or cut."""

    def __init__(self, address: str, connection: str) -> None:
        self.events: list[str] = []
        self.claim = Claim(address, connection, granted=lambda: self.events.append("granted"),
                           cut=lambda: self.events.append("cut"))


def claims(shares: Shares, address: str, connection: str, n: int) -> list[Call]:
    calls = [Call(address, connection) for _ in range(n)]
    for call in calls:
        shares.claim(call.claim)
    return calls


def test_peer_strings_split_into_address_and_connection():
    assert peer_of("ipv4:10.0.0.7:51234") == ("ipv4:10.0.0.7", "ipv4:10.0.0.7:51234")
    assert peer_of("ipv6:[::1]:40000") == ("ipv6:[::1]", "ipv6:[::1]:40000")
    assert peer_of("unix:/run/petal.sock") == ("unix:/run/petal.sock", "unix:/run/petal.sock")


def test_a_call_takes_the_oldest_slot_of_the_address_that_holds_more():
    shares = Shares(slots=4, waiting=0)
    first, second = claims(shares, "attacker", "a1", 2), claims(shares, "attacker", "a2", 2)
    normal = Call("normal", "n1")
    assert shares.claim(normal.claim) == HOLDING
    assert first[0].events == ["cut"] and all(not call.events for call in first[1:] + second)


def test_within_one_address_a_connection_takes_a_slot_from_the_connection_that_holds_more():
    shares = Shares(slots=4, waiting=0)
    attacker = claims(shares, "host", "a1", 3) + claims(shares, "host", "a2", 1)
    normal = Call("host", "n1")
    assert shares.claim(normal.claim) == HOLDING
    assert attacker[0].events == ["cut"], "the oldest of the connection holding the most"
    again = Call("host", "n1")
    assert shares.claim(again.claim, park=False) == HOLDING, "a1 still holds 2, n1 1"
    assert attacker[1].events == ["cut"]
    third = Call("host", "n1")
    assert shares.claim(third.claim, park=False) == REFUSED, "no connection holds more than n1's 2"


def test_a_call_waits_when_no_peer_holds_more_and_takes_a_place_from_one_that_waits_with_more():
    shares = Shares(slots=2, waiting=2)
    held = claims(shares, "b", "b1", 1) + claims(shares, "b", "b2", 1)
    waiting = [Call("b", "b1"), Call("b", "b1")]
    assert [shares.claim(call.claim) for call in waiting] == [PARKED, PARKED], "no connection holds more than b1"
    assert shares.claim(Call("b", "b1").claim) == REFUSED, "and no place to wait is held by one with more"
    other = Call("b", "b2")
    assert shares.claim(other.claim) == PARKED and waiting[0].events == ["cut"], "b2 takes b1's oldest place"
    assert not any(call.events for call in held)


def test_a_slot_given_back_goes_to_the_waiting_call_whose_peer_holds_the_fewest():
    shares = Shares(slots=2, waiting=4)
    attacker = claims(shares, "attacker", "a1", 2)
    queued = claims(shares, "attacker", "a1", 2)
    normal = Call("normal", "n1")
    assert shares.claim(normal.claim) == HOLDING and attacker[0].events == ["cut"]
    attacker[1].claim.release()
    assert queued[0].events == ["granted"], "the slot goes to the attacker's oldest waiting call: only it waits"
    waiting = Call("normal", "n1")
    assert shares.claim(waiting.claim) == PARKED, "the attacker holds 1 slot, the normal client 1: it waits"
    normal.claim.release()
    assert waiting.events == ["granted"] and not queued[1].events, "the normal address now holds none"
