"""What one page hash costs the core, and what other ways to hash would cost.

The core keys every page by a SHA-256 chain (``fabric.cache.keys.chain_hashes``:
each page's hash is ``sha256(previous hash + page)``), one hashlib call per
page. This times, in ns per page over a request of ``--pages`` random pages:

- ``chain_hashes``: the core's function;
- ``copy_context``: the same chain, each hash from a copy of a prepared context
  (skips the digest lookup a new context makes);
- ``builtin_sha256``: the same chain with CPython's own SHA-256 (not OpenSSL);
- ``running_state``: a different chain, the hash of everything so far
  (``update`` then a copied context's digest): cheaper, but other keys;
- ``one_call``: the whole request hashed in one call: the floor set by the
  hashing itself rather than by calling it once per page.

Each is the best of ``--repeat`` timings, taken in turns. The last line is one JSON object.

    python3 bench/page_hashing.py              # page 16 (64 bytes a page)
    python3 bench/page_hashing.py --page 64
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
import timeit

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fabric.cache.keys import TOKEN_BYTES, chain_hashes

try:  # CPython's own implementation, named _sha2 from 3.12 on
    from _sha2 import sha256 as builtin_sha256  # type: ignore[import-not-found]
except ImportError:
    from _sha256 import sha256 as builtin_sha256  # type: ignore[import-not-found,no-redef]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--page", type=int, default=16, help="tokens a page (default 16)")
    ap.add_argument("--pages", type=int, default=500, help="pages a request (default 500)")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    pb = args.page * TOKEN_BYTES
    data, seed = os.urandom(pb * args.pages), os.urandom(32)
    ends = range(0, len(data), pb)
    prepared = hashlib.sha256()

    def copy_context() -> list[bytes]:
        out, prev, copy = [], seed, prepared.copy
        for s in ends:
            h = copy()
            h.update(prev + data[s : s + pb])
            prev = h.digest()
            out.append(prev)
        return out

    def builtin() -> list[bytes]:
        prev = seed
        return [prev := builtin_sha256(prev + data[s : s + pb]).digest() for s in ends]

    def running_state() -> list[bytes]:
        h, out = hashlib.sha256(seed), []
        for s in ends:
            h.update(data[s : s + pb])
            out.append(h.copy().digest())
        return out

    core = chain_hashes(seed, data, pb)
    assert copy_context() == core and builtin() == core, "same chain, same hashes"
    ways = {
        "chain_hashes": lambda: chain_hashes(seed, data, pb),
        "copy_context": copy_context,
        "builtin_sha256": builtin,
        "running_state": running_state,
        "one_call": lambda: hashlib.sha256(data).digest(),
    }
    number = max(1, 20_000 // args.pages)
    out: dict = {"page": args.page, "page_bytes": pb, "pages": args.pages}
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(args.repeat):  # interleaved, so a slow stretch of the machine hits all
        for name, fn in ways.items():
            best[name] = min(best[name], timeit.timeit(fn, number=number))
    for name in ways:
        out[f"{name}_ns_per_page"] = round(best[name] / number / args.pages * 1e9, 1)
    base = out["chain_hashes_ns_per_page"]
    for name in ways:
        ns = out[f"{name}_ns_per_page"]
        print(f"{name:>16}: {ns:7.1f} ns a page ({ns / base:.2f}x chain_hashes)", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
