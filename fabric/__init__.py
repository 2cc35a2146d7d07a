"""kvfabric: a hierarchical KV-cache fabric for LLM serving.

``fabric`` is the pure core (radix tree over L1/L2/L3, allocators, policies,
consensus rules, config) plus the driver-facing client and CLI; importing it
never imports Ray.
"""

from __future__ import annotations

__version__ = "0.1.0"
