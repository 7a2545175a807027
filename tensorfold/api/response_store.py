"""The Responses API's store: the newest responses by id, for previous_response_id, GET, DELETE
and input_items.

It keeps the newest 1,024 responses, at most 256 MiB, in memory, or also in an SQLite file that
survives a restart; the oldest go first when either budget is passed. A response is put whole
(the service stores it before its last event or body goes out), so a reader never sees half.
The SQLite file also keeps the key encrypted reasoning is signed with (key()), so that reasoning
tokens survive a restart as the responses do.
"""
import json
from collections import OrderedDict
from dataclasses import dataclass

STORE_ENTRIES = 1024
STORE_BYTES = 256 << 20


@dataclass
class StoredResponse:
    response: dict                 # the response object as returned
    input_items: list[dict]        # this turn's input items, as normalised
    conversation: list[dict]       # chat messages through this reply (instructions left out)
    size: int = 0


class ResponseStore:
    """The newest responses, by id, within an entry and a byte budget: in memory, or in an
    SQLite file (`path`, the standard library's sqlite3) that survives a restart."""

    def __init__(self, max_entries: int = STORE_ENTRIES, max_bytes: int = STORE_BYTES, path: str | None = None):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._db = None
        if path is not None:
            import sqlite3

            self._db = sqlite3.connect(path, check_same_thread=False)
            self._db.execute("CREATE TABLE IF NOT EXISTS responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                             "id TEXT UNIQUE, data TEXT)")
            for (data,) in self._db.execute("SELECT data FROM responses ORDER BY seq"):
                self._remember(StoredResponse(**json.loads(data)))

    def key(self, make) -> bytes | None:
        """The reasoning key kept in the SQLite file, made by `make()` the first time; None in memory."""
        if self._db is None:
            return None
        with self._db:
            self._db.execute("CREATE TABLE IF NOT EXISTS secrets (name TEXT PRIMARY KEY, value BLOB)")
            row = self._db.execute("SELECT value FROM secrets WHERE name = 'reasoning'").fetchone()
            if row is None:
                row = (make(),)
                self._db.execute("INSERT INTO secrets (name, value) VALUES ('reasoning', ?)", row)
        return bytes(row[0])

    def put(self, entry: StoredResponse) -> None:
        self.delete(entry.response["id"])
        data = json.dumps({"response": entry.response, "input_items": entry.input_items,
                           "conversation": entry.conversation})
        entry.size = len(data)
        evicted = self._remember(entry)
        if self._db is not None:
            with self._db:
                self._db.execute("INSERT INTO responses (id, data) VALUES (?, ?)", (entry.response["id"], data))
                self._db.executemany("DELETE FROM responses WHERE id = ?", [(i,) for i in evicted])

    def _remember(self, entry: StoredResponse) -> list[str]:
        """Keep `entry` in memory; returns the ids evicted to stay within the budgets."""
        entry.size = entry.size or len(json.dumps([entry.response, entry.input_items, entry.conversation]))
        self._items[entry.response["id"]] = entry
        self._bytes += entry.size
        evicted = []
        while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
            old_id, old = self._items.popitem(last=False)
            self._bytes -= old.size
            evicted.append(old_id)
        return evicted

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        old = self._items.pop(response_id, None)
        if old is None:
            return False
        self._bytes -= old.size
        if self._db is not None:
            with self._db:
                self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return True
