"""What every adapter keeps of its sessions: the session table (keys, namespaces, which idle session gives way
when room runs short), the lock of an entry, and the snapshot format of a saved conversation."""

from kvagent.sessions.lock import EntryLock
from kvagent.sessions.snapshot import Snapshot, SnapshotError, SnapshotSignatureError, sign, unsign
from kvagent.sessions.table import (LFU, LRU, CloseParking, NoRoom, OrphansFirst, Parking, ReclaimStrategy,
                                    SessionTable, TableEntry)

__all__ = ["LFU", "LRU", "CloseParking", "EntryLock", "NoRoom", "OrphansFirst", "Parking", "ReclaimStrategy",
           "SessionTable", "Snapshot", "SnapshotError", "SnapshotSignatureError", "TableEntry", "sign", "unsign"]
