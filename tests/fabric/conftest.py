from __future__ import annotations

from fabric.config import FabricConfig


def small_config(*overrides: str) -> FabricConfig:
    """TP=2 x PP=2, tiny pools and model: every path of the data plane in milliseconds."""
    return FabricConfig().with_overrides(
        [
            "topology.tp=2",
            "topology.pp=2",
            "cache.page_size=4",
            "cache.device_tokens=96",
            "cache.host_tokens=192",
            "cache.load_back_threshold=0",
            "model.layers=2",
            "model.kv_heads=2",
            "model.head_dim=8",
            "runtime.step_interval_s=0",
            "storage.backend=none",
            *overrides,
        ]
    )


def prompt(seed: int, pages: int, shared: int = 0, page_size: int = 4) -> list[int]:
    """``shared`` pages common to every seed, then pages unique to ``seed``."""
    common = [7000 + t for t in range(shared * page_size)]
    return common + [seed * 1000 + t for t in range((pages - shared) * page_size)]
