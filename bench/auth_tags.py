"""What an authenticated L3 page's tag costs against the CRC-32 it replaces, on
pages the CPU cache holds (as a direct read checks them, ``fabric.l3.run_reads``):
the two tags kvfabric writes (``PageAuth.tag_ok``: AEGIS-128X4's, which pages
from 64 KiB carry, and AES-GCM's, which smaller ones carry), AEGIS-128X4's MAC
mode (the tag pages from 64 KiB carried before: read, no longer written),
zlib-ng's CRC-32,
and keyed BLAKE3 where ``blake3`` is installed (``pip install -e '.[bench]'``),
each on one thread and on two at once (whether the library releases the GIL
while it hashes).

    python3 bench/auth_tags.py [--page-kib 256] [--pages 4] [--seconds 1] [--others]

Prints one JSON line: GB/s by check and thread count, ``tag`` (the one a page of
``--page-kib`` carries) and ``tag_over_crc_cpu`` (its CPU per byte over the
CRC's, one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np

from fabric.l3.auth import AEGIS_MAC_NONCE, AEGIS_NONCE, GCM_NONCE, PageAuth
from fabric.l3.format import checksum


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--page-kib", type=int, default=256)
    p.add_argument("--pages", type=int, default=4, help="pages a thread checks over and over")
    p.add_argument("--seconds", type=float, default=1.0, help="per check and thread count")
    p.add_argument(
        "--others",
        action="store_true",
        help="also cryptography's other MACs (ChaCha20-"
        "Poly1305, Poly1305, AES-OCB3, AES-GCM-SIV): a swap of the tag's primitive",
    )
    return p.parse_args()


def checks(others: bool = False) -> dict:
    auth, bound = PageAuth(os.urandom(32)), b"k" * 64 + b"\0model"
    found = {"crc32": checksum}
    for name, nonce in (
        ("aegis_128x4_tag", os.urandom(AEGIS_NONCE)),
        ("aes_gcm_tag", os.urandom(GCM_NONCE)),
        ("aegis_128x4_mac_mode_tag", os.urandom(AEGIS_MAC_NONCE)),
    ):
        found[name] = lambda page, nonce=nonce: auth.tag_ok(nonce, bytes(16), bound, page)
    if others:
        found.update(other_macs())
    try:
        import blake3
    except ImportError:
        return found
    key = os.urandom(32)
    found["blake3_keyed"] = lambda page: blake3.blake3(page, key=key).digest()
    return found


def other_macs() -> dict:
    """The other MACs ``cryptography`` offers, each over the page as the tag
    kvfabric uses is (associated data, a short plaintext): what a swap of the
    primitive could gain (``--others``)."""
    from cryptography.hazmat.primitives.ciphers import aead
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    bound, nonce, key = b"k" * 64 + b"\0model", os.urandom(12), os.urandom(32)
    made = {
        "chacha20_poly1305": aead.ChaCha20Poly1305(key),
        "aes_ocb3": aead.AESOCB3(key[:16]),
        "aes_gcm_siv": aead.AESGCMSIV(key[:16]),
    }
    found = {name: (lambda page, a=a: a.encrypt(nonce, bound, page)) for name, a in made.items()}
    found["poly1305"] = lambda page: Poly1305.generate_tag(key, page)
    return found


def rate(check, pages: np.ndarray, threads: int, seconds: float) -> float:
    """GB/s of ``check`` over ``pages`` (each thread its own copy of them)."""
    done = [0] * threads
    copies = [pages.copy() for _ in range(threads)]
    start = threading.Barrier(threads + 1)
    end = time.perf_counter() + seconds + 0.05

    def work(i: int) -> None:
        start.wait()
        while time.perf_counter() < end:
            for page in copies[i]:
                check(page)
            done[i] += copies[i].nbytes

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    began = time.perf_counter()
    for w in workers:
        w.join()
    return sum(done) / (time.perf_counter() - began) / 1e9


def main() -> None:
    args = parse()
    rng = np.random.default_rng(0)
    pages = rng.integers(0, 256, (args.pages, args.page_kib * 1024), dtype=np.uint8)
    out: dict = {}
    for name, check in checks(args.others).items():
        for threads in (1, 2):
            print(f"auth_tags: {name}, {threads} thread(s)", file=sys.stderr, flush=True)
            out[f"{name}_{threads}t_gb_per_s"] = round(rate(check, pages, threads, args.seconds), 2)
    tag = (
        "aegis_128x4_tag" if PageAuth.nonce_bytes(pages.shape[1]) == AEGIS_NONCE else "aes_gcm_tag"
    )
    out["tag"] = tag
    out["tag_over_crc_cpu"] = round(out["crc32_1t_gb_per_s"] / out[f"{tag}_1t_gb_per_s"], 2)
    out["page_kib"] = args.page_kib
    print(json.dumps(out))


if __name__ == "__main__":
    main()
