"""Workloads of other shapes than ``fabric.tools.workloads`` (chat, agent, rag,
mixed), kept apart from them on purpose: no eviction policy was tuned on these.
``bench/eviction_policies.py`` scores every policy on them too (its default ``--workloads``), so a
default is judged on traffic it never saw. Each is seeded, in the trace's own
terms (block ids of 512 tokens):

- ``scan_hot``: a few long few-shot templates, very popular (Zipf 1.2), each
  request one of them plus its own question, while 45% of requests are one-off
  long documents never seen again (a scan through the cache);
- ``tenant_gaps``: 64 tenants, each with its own system prompt and a handful of
  conversations whose next turn comes back after a heavy-tailed gap (Pareto,
  so some within a few requests and some thousands later); tenants' activity
  Zipf 0.8;
- ``drift``: the popular prefixes change: phases of 400 requests, each with a
  new hot set of 24 prefixes (3-10 blocks, Zipf 1.0 within it), a fifth of the
  requests still asking for the previous phase's set, and a quick follow-up
  (the same prefix again 1-3 requests later) a quarter of the time;
- ``churn``: short chats that come and go: 40% of requests start a new chat
  over one of 20 system prompts (2-6 blocks), at most 24 chats live (one
  dropped at random for each new one past that), each turn the whole chat so
  far plus 1-3 new blocks — recency is nearly everything.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fabric.tools.workload import BLOCK_TOKENS, Request


def _zipf(n: int, s: float) -> list[float]:
    return [1 / (rank + 1) ** s for rank in range(n)]


def _request(i: int, blocks: list[int], rng: random.Random) -> Request:
    length = (len(blocks) - 1) * BLOCK_TOKENS + rng.randint(1, BLOCK_TOKENS)
    return Request(i * 100, length, rng.randint(32, 256), tuple(blocks))


def scan_hot(num_requests: int, seed: int = 0) -> list[Request]:
    rng, ids = random.Random(seed), itertools.count(5 * 10**9)
    templates = [[next(ids) for _ in range(rng.randint(8, 16))] for _ in range(12)]
    weights = _zipf(len(templates), 1.2)
    out = []
    for i in range(num_requests):
        if rng.random() < 0.45:  # a document read once
            blocks = [next(ids) for _ in range(rng.randint(10, 30))]
        else:
            blocks = [*rng.choices(templates, weights)[0], next(ids)]
        out.append(_request(i, blocks, rng))
    return out


def tenant_gaps(num_requests: int, seed: int = 0) -> list[Request]:
    rng, ids = random.Random(seed), itertools.count(6 * 10**9)
    tenants = [[next(ids) for _ in range(rng.randint(2, 4))] for _ in range(64)]
    weights = _zipf(len(tenants), 0.8)
    due: dict[int, list[list[int]]] = {}  # request index -> conversations coming back
    out = []
    for i in range(num_requests):
        waiting = due.pop(i, [])
        if waiting and rng.random() < 0.7:
            chat = waiting.pop()
            for other in waiting:  # the rest come back a little later
                due.setdefault(i + 1, []).append(other)
        else:
            due.setdefault(i + 1, []).extend(waiting)
            chat = list(rng.choices(tenants, weights)[0])
        chat.extend(next(ids) for _ in range(rng.randint(1, 2)))  # the new message
        out.append(_request(i, chat, rng))
        chat.append(next(ids))  # the answer
        if len(chat) < 40 and rng.random() < 0.8:
            gap = min(int(rng.paretovariate(0.9)) * 3, 20 * num_requests)
            due.setdefault(i + 1 + gap, []).append(chat)
    return out


def drift(num_requests: int, seed: int = 0) -> list[Request]:
    rng, ids = random.Random(seed), itertools.count(7 * 10**9)
    phase: list[list[int]] = []
    previous: list[list[int]] = []
    weights = _zipf(24, 1.0)
    again: dict[int, list[int]] = {}
    out = []
    for i in range(num_requests):
        if i % 400 == 0:
            previous = phase
            phase = [[next(ids) for _ in range(rng.randint(3, 10))] for _ in range(24)]
        if i in again:
            blocks = again.pop(i)
        else:
            pool = previous if previous and rng.random() < 0.2 else phase
            blocks = [*rng.choices(pool, weights)[0], next(ids)]
        out.append(_request(i, blocks, rng))
        if rng.random() < 0.25:
            again.setdefault(i + rng.randint(1, 3), [*blocks, next(ids)])
    return out


def churn(num_requests: int, seed: int = 0) -> list[Request]:
    rng, ids = random.Random(seed), itertools.count(8 * 10**9)
    prompts = [[next(ids) for _ in range(rng.randint(2, 6))] for _ in range(20)]
    chats: list[list[int]] = []
    out = []
    for i in range(num_requests):
        if not chats or rng.random() < 0.4:
            chats.append(list(rng.choice(prompts)))
            if len(chats) > 24:
                chats.pop(rng.randrange(len(chats)))
        chat = rng.choice(chats)
        chat.extend(next(ids) for _ in range(rng.randint(1, 3)))
        out.append(_request(i, chat, rng))
        chat.append(next(ids))  # the answer
    return out


UNSEEN: dict[str, Callable[[int, int], list[Request]]] = {
    "scan_hot": scan_hot,
    "tenant_gaps": tenant_gaps,
    "drift": drift,
    "churn": churn,
}
