from __future__ import annotations

import pytest

from fabric.cache.hicache import HiCache
from fabric.cache.inprocess import InProcessController
from fabric.config import CacheConfig, PrefetchConfig

P = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 1.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_cache(
    device_pages: int = 8,
    host_pages: int = 16,
    immediate: bool = False,
    clock: FakeClock | None = None,
    prefetch: PrefetchConfig | None = None,
    **cache_options,
) -> HiCache:
    cfg = CacheConfig(
        page_size=P,
        device_tokens=device_pages * P,
        host_tokens=host_pages * P,
        **{"load_back_threshold": 0, **cache_options},
    )
    ctl = InProcessController(device_pages, host_pages, P, immediate=immediate)
    return HiCache(cfg, ctl, prefetch, clock=clock or FakeClock())


def toks(*pages: int) -> list[int]:
    """Tokens of whole pages, page ``n`` being ``[n, n, n, n]``."""
    return [t for p in pages for t in [p] * P]


def put(cache: HiCache, tokens: list[int], namespace: str = "default", priority: int = 0):
    """Insert like a server would: match, lease pages for the rest, insert."""
    key = cache.key(tokens, namespace)
    m = cache.match_prefix(key)
    pages = cache.alloc_device(key.num_tokens - m.device_tokens)
    assert pages is not None
    result = cache.insert(key, m.device_pages + pages, priority)
    cache.write_through()
    return result


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
