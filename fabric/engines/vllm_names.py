"""vLLM's own names of the pages a connector stores, for the fabric's KV events.

The fabric names an engine page by its chain hash (``fabric.cache.keys``); vLLM
names the same block by its block hash (``Request.block_hashes``: SHA-256 over
the parent's hash, the block's tokens and its extra keys, from a fixed seed, so
every replica of a model computes the same), and a KV-aware router (llm-d's
precise scorer, Dynamo's, Ray Serve's) indexes vLLM's own events by that hash,
or by the tokens. So as the scheduler side plans a request's stores it pairs
each page with vLLM's hash of its block and the block's token ids, and the
link sends the pairs with the report of the page's first store
(``PageName``); the coordinator's tree keeps them while it knows the page, and
its events of engine pages carry them (``BlockStored.engine_hashes``). A
router then sees a block it knows from a replica's own events in a node's L2
or in L3 under the same key.

Only while the fabric publishes KV events (``wanted``, set as the link
attaches), and bounded: at most ``max_names`` pairs wait for their report
(the oldest go first: their events carry the fabric's hashes instead).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from fabric.cache.engine_input import MAX_PAGES_PER_CALL, PageName
from fabric.cache.keys import pack_tokens


class PageNames:
    def __init__(self, max_names: int = MAX_PAGES_PER_CALL) -> None:
        self.max_names = max_names
        self.wanted = False  # whether the fabric publishes KV events
        self._waiting: OrderedDict[bytes, PageName] = OrderedDict()

    def __len__(self) -> int:
        return len(self._waiting)

    def learn(self, request: Any, hashes: list[bytes], start: int, end: int, size: int) -> None:
        """Pair pages ``[start, end)`` of ``request`` (``hashes``: the connector's
        page hashes; ``size``: tokens a block) with vLLM's block hashes and their
        tokens."""
        if not self.wanted:
            return
        theirs = getattr(request, "block_hashes", None) or []
        tokens = request.all_token_ids
        for i in range(start, min(end, len(theirs), len(hashes))):
            engine_hash = theirs[i]
            if not isinstance(engine_hash, bytes) or not engine_hash:
                return  # (a vLLM whose hashes are not bytes: its events are its own)
            block = tokens[i * size : (i + 1) * size]
            self._waiting[hashes[i]] = PageName(hashes[i], bytes(engine_hash), pack_tokens(block))
            self._waiting.move_to_end(hashes[i])
        while len(self._waiting) > self.max_names:
            self._waiting.popitem(last=False)

    def take(self, hashes: Iterable[bytes]) -> list[PageName]:
        """The names of ``hashes`` still waiting (each sent once)."""
        if not self._waiting:  # (no events published: every report skips this)
            return []
        out = []
        for h in hashes:
            name = self._waiting.pop(h, None)
            if name is not None:
                out.append(name)
        return out
