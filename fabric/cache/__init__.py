"""The pure hierarchical cache: keys, the radix tree over L1/L2/L3, allocators,
tier moves, L3 bookkeeping and integrity checks. No Ray, no torch."""
