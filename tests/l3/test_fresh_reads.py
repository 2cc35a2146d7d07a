"""A page another process stored a moment ago is read, not called missing: a
segment store picks up other writers' records at most once a second on its own,
so a reader that misses a page looks again after a rescan (``get_fresh``) before
it is missing — an engine would otherwise forget a page the index calls whole,
for every engine."""

from __future__ import annotations

import numpy as np

from fabric.engines.store import DirectStore, StoreOptions
from fabric.l3.format import Provenance
from fabric.l3.service import StorageService, provenance_bytes

PROVENANCE = Provenance("m", "vllm-block/x", "uint8", (16,), 1)
KEYS = [f"{i:064x}.0123456789abcdef.0-0-0" for i in range(3)]


def test_a_page_another_writer_stored_after_this_reader_looked_is_read(tmp_path):
    options = StoreOptions(path=str(tmp_path))
    reader, writer = DirectStore(options, "vllm"), DirectStore(options, "vllm")
    reader.present(KEYS)  # the reader has just looked at the directory
    rows = np.arange(3 * 16, dtype=np.uint8).reshape(3, 16)
    assert writer.store(KEYS, rows, PROVENANCE) == [True] * 3
    out = np.zeros_like(rows)
    assert reader.load(KEYS, out, PROVENANCE) == 3  # within a second of its last look
    assert np.array_equal(out, rows)
    out2 = np.zeros_like(rows)
    assert reader.load([*KEYS[:1], "f" * 64 + ".0123456789abcdef.0-0-0"], out2[:2], PROVENANCE) == 1
    for store in (reader, writer):
        store.close()


def test_the_storage_actors_engine_reads_look_again_too(tmp_path):
    from fabric.l3 import make_backend

    assert provenance_bytes(PROVENANCE) == 16
    service_backend = make_backend("segment", PROVENANCE, 16, {"path": str(tmp_path)})
    service = StorageService.__new__(StorageService)
    service.backend = service_backend
    writer = DirectStore(StoreOptions(path=str(tmp_path)), "vllm")
    rows = np.full((3, 16), 9, dtype=np.uint8)
    writer.store(KEYS, rows, PROVENANCE)
    got = service.engine_load(KEYS, PROVENANCE)
    assert got.shape == (3, 16) and np.array_equal(got, rows)
    writer.close()
    service_backend.close()
