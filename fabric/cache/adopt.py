"""A restarted coordinator's L2: the pages every rank still holds, put back into an
empty tree (``fabric.rank.index`` says how ranks name them).

Only pages every rank names alike are offered (``common_pages``: MIN over ranks
again — a page some rank lacks or holds as something else is left); a page is
adopted only if its tokens hash, from its parent's chain hash, to its name (so
a wrong name on every rank still adopts nothing), and only below a parent that
was adopted, so the tree stays prefix-closed. Runs of pages without a branch
become one node each.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Sequence

from fabric.cache.allocator import as_pages
from fabric.cache.events import Medium
from fabric.cache.keys import namespace_seed
from fabric.errors import InvalidInput

# ``(slot, namespace, chain hash, parent hash, tokens)``: one named L2 slot.
Entry = tuple[int, str, bytes, bytes, bytes]


def common_pages(inventories: Sequence[Iterable[Entry]]) -> list[Entry]:
    """The slots every rank names alike (one inventory per rank)."""
    if not inventories:
        return []
    first = {e[0]: e for e in inventories[0]}
    for other in inventories[1:]:
        theirs = {e[0]: e for e in other}
        first = {s: e for s, e in first.items() if theirs.get(s) == e}
    return list(first.values())


def adopt_host(cache, entries: Iterable[Entry]) -> int:
    """Put the named L2 pages ``entries`` into ``cache``'s empty tree as L2-only
    nodes; their slots leave the L2 allocator. Returns tokens adopted."""
    tree, host = cache.tree, cache.ctl.host
    if tree.root.children:
        raise InvalidInput("L2 pages are adopted only into an empty tree")
    pb = tree.page_bytes
    pages: dict[tuple[str, bytes], tuple[int, bytes, bytes]] = {}
    used: set[int] = set()
    for slot, ns, h, parent, tokens in entries:
        ok = isinstance(slot, int) and 0 <= slot < host.num_pages and len(tokens) == pb
        if ok and slot not in used and (ns, h) not in pages:
            pages[ns, h] = (slot, parent, tokens)
            used.add(slot)
    children: dict[tuple[str, bytes], list[bytes]] = defaultdict(list)
    for (ns, h), (_, parent, _) in pages.items():
        children[ns, parent].append(h)
    now, sha256, adopted = cache.clock(), hashlib.sha256, as_pages()
    for ns in sorted({ns for ns, _ in pages}):
        stack = [(tree.root, namespace_seed(ns))]
        while stack:
            above, prev = stack.pop()
            for h in children.get((ns, prev), ()):
                slots, data, last, cur = as_pages(), [], prev, h
                while True:  # a run of pages without a branch: one node
                    slot, _, tokens = pages[ns, cur]
                    if sha256(last + tokens).digest() != cur:
                        break  # not this page's name: neither it nor below it
                    slots.append(slot)
                    data.append(tokens)
                    last = cur
                    below = children.get((ns, cur), ())
                    if len(below) != 1:
                        break
                    cur = below[0]
                if not slots:
                    continue
                node = tree.attach(above, ns, b"".join(data), now, 0)
                node.host_value = slots
                tree.refresh(node)
                tree.refresh(above)
                cache.events.stored(node, Medium.HOST)
                adopted.extend(slots)
                stack.append((node, last))
    host.take(adopted)
    return len(adopted) * tree.page_size
