"""PinTable: session and group pins, bounded and least-recently-used first out."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Literal

from cache_policy.types import ReplicaId

PinKind = Literal["session", "group"]


@dataclass(frozen=True)
class Pin:
    """Where a session or GRPO group is pinned, and how much of that replica's load it is.

    ``own_in_flight`` counts this key's requests dispatched to ``replica`` and not yet
    finished; it is subtracted from the replica's load before judging it overloaded, so
    that a group of 16 arriving together is not moved off its replica by its own members.
    """

    replica: ReplicaId
    own_in_flight: int = 0

    def __post_init__(self) -> None:
        assert self.own_in_flight >= 0, f"bug: negative own_in_flight {self.own_in_flight}"


class PinTable:
    """``(kind, key) -> Pin`` for sessions and groups together, at most ``max_pins`` entries.

    Order: least recently used first; ``get``, ``record``, ``started`` touch an entry.
    Past capacity the least recently used pin is dropped (its key routes afresh, usually
    back to the same replica through the prefix index).
    """

    def __init__(self, max_pins: int) -> None:
        if max_pins < 1:
            raise ValueError(f"max_pins must be >= 1, got {max_pins}")
        self.max_pins = max_pins
        self._pins: OrderedDict[tuple[PinKind, str], Pin] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, kind: PinKind, key: str) -> Pin | None:
        """The pin of ``key``, or ``None``."""
        pin = self._pins.get((kind, key))
        if pin is not None:
            self._pins.move_to_end((kind, key))
        return pin

    def record(self, kind: PinKind, key: str, replica: ReplicaId) -> None:
        """Pin ``key`` to ``replica`` (a move resets ``own_in_flight``)."""
        old = self._pins.get((kind, key))
        if old is None or old.replica != replica:
            self._pins[(kind, key)] = Pin(replica)
        self._pins.move_to_end((kind, key))
        while len(self._pins) > self.max_pins:
            self._pins.popitem(last=False)

    def started(self, kind: PinKind, key: str, replica: ReplicaId) -> None:
        """One more request of ``key`` runs on ``replica`` (counted if it is the pin's)."""
        pin = self._pins.get((kind, key))
        if pin is not None and pin.replica == replica:
            self._pins[(kind, key)] = replace(pin, own_in_flight=pin.own_in_flight + 1)

    def finished(self, kind: PinKind, key: str, replica: ReplicaId) -> None:
        """A request of ``key`` ended on ``replica``; never counts below zero."""
        pin = self._pins.get((kind, key))
        if pin is not None and pin.replica == replica and pin.own_in_flight > 0:
            self._pins[(kind, key)] = replace(pin, own_in_flight=pin.own_in_flight - 1)

    def replicas(self) -> set[ReplicaId]:
        """Replicas that hold at least one pin."""
        return {p.replica for p in self._pins.values()}

    def drop_replica(self, replica: ReplicaId) -> None:
        """Forget every pin on ``replica``."""
        for k in [k for k, p in self._pins.items() if p.replica == replica]:
            del self._pins[k]

    def check_integrity(self) -> None:
        """Raise ``RuntimeError('bug: ...')`` if the table is over capacity."""
        if len(self._pins) > self.max_pins:
            raise RuntimeError(f"bug: {len(self._pins)} pins > max_pins {self.max_pins}")
