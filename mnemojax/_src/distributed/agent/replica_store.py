"""The buddy replicas an agent keeps for its ring predecessor (pure: no JAX, no I/O)."""

from __future__ import annotations

import threading

from mnemojax._src import checksum as checksums
from mnemojax._src.errors import SnapshotCorruptError


class ReplicaStore:
    """Snapshots received from ring neighbours: ``origin -> {step: (payload, crc, world)}``,
    where ``crc`` is the payload's CRC32C (`checksum`) as its worker published it and
    ``world`` the generation that produced it.

    Keeps the ``keep`` newest copies per origin, newest by (world, step): a new world's
    replayed steps are newer than the old world's later ones. So the previous step stays
    available while a newer copy is in flight or when the survivors resume one step back.

    Copies of a former ring predecessor (a worker that died, or that the ring moved) are
    outranked by no later copy of theirs: they go when a new world forms from a newer
    world's copies (`forget_before`), or when a copy from a newer world needs their room
    under the host's budget (`evict_for`).
    """

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._by_origin: dict[int, dict[int, tuple[bytes | bytearray, int, int]]] = {}
        self._lock = threading.Lock()  # replication puts while a survivor asks or fetches
        # Copies from worlds older than this are dropped and refused (`forget_before`).
        self.floor = 0
        # (world, step) of the copies the current world resumed from: what a second
        # failure falls back to until the new world holds a step whole (`evict_for`).
        self.agreed: tuple[int, int] | None = None

    def put(self, origin: int, step: int, payload: bytes | bytearray, crc: int, *,
            generation: int = 0, checked: bool = False) -> None:
        """Stores a copy after checking its checksum (raises `SnapshotCorruptError` if it
        fails; ``checked``: the caller just did). The payload is kept as given (a received frame: no copy), and the copies
        it outdates go first, so the host holds at most ``keep`` copies of ``origin`` plus
        the one being received. A copy of a step held from a newer world is not replaced."""
        if not checked and checksums.checksum(payload) != crc:
            raise SnapshotCorruptError(
                f"replica of worker {origin} step {step} fails its {checksums.NAME} check")
        with self._lock:
            kept = self._kept_with(origin, step, generation)
            if kept is None:
                return
            held = self._by_origin.setdefault(origin, {})
            for old in [s for s in held if s not in kept]:
                del held[old]
            if step in kept:  # (a copy older than every one held is not kept)
                held[step] = (payload, crc, generation)

    def _kept_with(self, origin: int, step: int, generation: int) -> list[int] | None:
        """The steps of ``origin`` kept once its copy of ``step`` from world ``generation``
        arrives, ranked by (world, step), or None when that copy is ignored: a late send
        of a world below the floor (no agreement can choose it; its sender hears Ok, its
        worker being in a newer world anyway), or a step held from a newer world. Call
        with the lock held."""
        held = self._by_origin.get(origin, {})
        if generation < self.floor or (step in held and held[step][2] > generation):
            return None
        order = {s: (g, s) for s, (_, _, g) in held.items()} | {step: (generation, step)}
        return sorted(order, key=order.__getitem__)[-self.keep:]

    def make_room(self, origin: int, step: int, *, generation: int = 0) -> None:
        """Before ``origin``'s copy of ``step`` from world ``generation`` arrives, from a
        worker that publishes in series: when it outranks every copy held (by world, then
        step, as `put` ranks them), drops a copy of the same step from an older world (an
        abandoned step the new world replays) or, with ``keep`` copies held, the oldest,
        so the host never holds ``keep + 1`` copies of ``origin``. A copy that does not
        outrank them all (a resend of a step held, a new buddy's copy of a resumed step)
        drops nothing: it is received first, then ranked.

        Why that is safe: the worker published ``step`` after its buddy held its step
        before, and it finished ``step`` only once every worker had finished that step
        before and (in series) its buddy held it: a failure from now on resumes from that
        step or a newer one, in this world. A copy that then fails its check leaves that
        step.
        """
        with self._lock:
            held = self._by_origin.get(origin)
            if not held or generation < self.floor:
                return
            rank = {s: (g, s) for s, (_, _, g) in held.items()}
            if (generation, step) <= max(rank.values()):
                return
            if step in held:  # from an older world (outranked)
                del held[step]
                return
            while len(held) >= self.keep:
                del held[min(held, key=rank.__getitem__)]

    def forget_before(self, generation: int, *, resumed: int | None = None) -> int:
        """A new world formed from copies of world ``generation`` (its step ``resumed``;
        or, resuming from the persistent tier, ``generation`` is the new world and no copy
        held was complete): drops every copy from an older world and refuses any that
        arrives later. Returns the bytes freed.

        The trade: copies of a world are only ever moved after it ends (a late
        replication), never made, so a step of an older world that the agreement did not
        find complete never becomes complete; what goes is only an older world's step
        that was complete but ranked below the one chosen, a fall-back should the chosen
        step's copies be lost before the new world holds a step whole.
        """
        with self._lock:
            if resumed is not None:
                self.agreed = (generation, resumed) if resumed >= 0 else None
            if generation <= self.floor:
                return 0
            self.floor = generation
            freed = 0
            for origin, held in list(self._by_origin.items()):
                for step in [s for s, (_, _, g) in held.items() if g < generation]:
                    freed += len(held.pop(step)[0])
                if not held:
                    del self._by_origin[origin]
            return freed

    def evict_for(self, origin: int, step: int, generation: int, nbytes: int) -> int:
        """Makes up to ``nbytes`` of room for ``origin``'s copy of ``step`` from world
        ``generation``, by dropping copies of *other* origins from older worlds, oldest
        (world, step) first: a former ring predecessor's copies, which no later copy of
        theirs would ever replace. Drops nothing when they cannot make that room, or when
        `put` would not keep the copy anyway.

        Never dropped for a copy older than two steps past it: a copy of the step the
        current world resumed from (`agreed`). Until then the new world may hold no step
        whole, and a second failure falls back to it; from the sender's step ``s + 2``
        on, `put` drops the sender's own copy of that step too, as the two steps kept
        per origin allow. Other older-world copies are a fall-back the trade gives up:
        refusing the current predecessor's copies instead would leave its shards with no
        copy off its host for the rest of the world.

        Returns:
            The bytes freed.
        """
        with self._lock:
            kept = self._kept_with(origin, step, generation)
            if kept is None or step not in kept:
                return 0  # `put` would not keep it

            def protected(g: int, s: int) -> bool:
                return (g, s) == self.agreed and step < s + 2

            old = sorted(((g, s, o) for o, kept in self._by_origin.items() if o != origin
                          for s, (_, _, g) in kept.items()
                          if g < generation and not protected(g, s)))
            if sum(len(self._by_origin[o][s][0]) for _, s, o in old) < nbytes:
                return 0
            freed = 0
            for _, s, o in old:
                if freed >= nbytes:
                    break
                freed += len(self._by_origin[o].pop(s)[0])
                if not self._by_origin[o]:
                    del self._by_origin[o]
            return freed

    def steps(self, origin: int) -> list[int]:
        """The steps of ``origin`` held, oldest first (unchecked; `verify` checks)."""
        with self._lock:
            return sorted(self._by_origin.get(origin, {}))

    def nbytes(self) -> int:
        """Bytes of the copies held."""
        with self._lock:
            return sum(len(p) for held in self._by_origin.values() for p, _, _ in held.values())

    def get(self, origin: int, step: int) -> tuple[bytes | bytearray, int]:
        """The copy of ``origin``'s snapshot at ``step`` (KeyError if not held)."""
        with self._lock:
            payload, crc, _ = self._by_origin[origin][step]
            return payload, crc

    def verify(self) -> tuple[list[tuple[int, int, bytes | bytearray]], list[tuple[int, int]]]:
        """Checks every copy against its checksum again (memory can flip after the put).

        Returns:
            ``(origin, step, payload)`` of the good copies, and ``(origin, step)`` of the
            corrupt ones, which are dropped (never served).
        """
        with self._lock:
            copies = [(o, s, p, c) for o, held in self._by_origin.items()
                      for s, (p, c, _) in held.items()]
        good, bad = [], []
        for origin, step, payload, crc in copies:  # the checksums outside the lock
            if checksums.checksum(payload) == crc:
                good.append((origin, step, payload))
            else:
                bad.append((origin, step))
                with self._lock:
                    held = self._by_origin.get(origin, {})
                    if held.get(step, (None,))[0] is payload:
                        del held[step]
        return good, bad
