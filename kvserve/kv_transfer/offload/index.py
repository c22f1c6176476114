"""The scheduler side's record of what each tier holds: block hashes in least-recently-used
order, at most a tier's capacity in blocks. The workers hold the data and do what this record
decides (save, drop, load), so both agree without asking each other."""

from __future__ import annotations

from collections import OrderedDict

RAM, DISK = "ram", "disk"


class TierIndex:
    def __init__(self, name: str, capacity_blocks: int):
        self.name = name
        self.capacity = capacity_blocks
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, block_hash: int) -> list[int]:
        """Record (or refresh) a block; the hashes dropped to stay within capacity."""
        self._hashes[block_hash] = None
        self._hashes.move_to_end(block_hash)
        dropped = []
        while len(self._hashes) > self.capacity:
            dropped.append(self._hashes.popitem(last=False)[0])
        return dropped

    def touch(self, block_hash: int) -> None:
        if block_hash in self._hashes:
            self._hashes.move_to_end(block_hash)

    def discard(self, block_hash: int) -> bool:
        """Forget a block; whether the tier held it."""
        if block_hash not in self._hashes:
            return False
        del self._hashes[block_hash]
        return True
