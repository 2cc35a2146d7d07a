"""Named strategies for kvfabric: eviction order, write policy, prefetch stop policy.

Each family is a registry dict from name to a small object; ``get_*`` raises a
``ValueError`` that lists the known names when asked for an unknown one.
"""

from __future__ import annotations

from policies.eviction import EVICTION_POLICIES, EvictionPolicy, get_eviction_policy
from policies.prefetch import PREFETCH_STOP_POLICIES, PrefetchStopPolicy, get_prefetch_stop_policy
from policies.write import WRITE_POLICIES, WritePolicy, get_write_policy

__all__ = [
    "EVICTION_POLICIES",
    "PREFETCH_STOP_POLICIES",
    "WRITE_POLICIES",
    "EvictionPolicy",
    "PrefetchStopPolicy",
    "WritePolicy",
    "get_eviction_policy",
    "get_prefetch_stop_policy",
    "get_write_policy",
]
