"""Generated traces of three kinds of traffic, and a mix of them, in the trace's
own terms (``Request``: block ids of 512 tokens, Mooncake-style), for what-ifs
beyond the one production trace:

- ``chat``: multi-turn chats over a few shared system prompts, each turn the
  whole conversation so far plus a new message (``synthetic_trace``);
- ``agent``: agent loops: a long tool-use system prompt per agent kind, then
  iterations that each append a tool's output and the model's next action to
  the history and send all of it again; many loops run interleaved;
- ``rag``: retrieval: a short system prompt, a few documents from a large
  corpus (popular ones far more often, Zipf-like) in the order the retriever
  ranked them for this question, and the question; sometimes a follow-up on
  the same documents. The same document's blocks recur after different
  prefixes — the case where keying blocks by id alone overcounts hits;
- ``mixed``: the three interleaved (chat 40%, agent 30%, RAG 30%).

Every generator is seeded: the same arguments give the same trace.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from fabric.errors import InvalidInput
from fabric.tools.workload import BLOCK_TOKENS, Request, synthetic_trace


class _Ids:
    """Fresh block ids from ``start`` (each kind has its own range: a mix never
    shares a block between kinds)."""

    def __init__(self, start: int = 0) -> None:
        self.counter = itertools.count(start)

    def take(self, n: int) -> list[int]:
        return [next(self.counter) for _ in range(n)]


def _request(i: int, blocks: list[int], rng: random.Random, output: int) -> Request:
    """A request of ``blocks``, its last block partly filled."""
    length = (len(blocks) - 1) * BLOCK_TOKENS + rng.randint(1, BLOCK_TOKENS)
    return Request(i * 100, length, output, tuple(blocks))


def agent_trace(num_requests: int, seed: int = 0) -> list[Request]:
    """Interleaved agent loops over a few agent kinds (see the module docstring)."""
    rng, ids = random.Random(seed), _Ids(10**9)
    kinds = [ids.take(rng.randint(4, 8)) for _ in range(4)]  # tool-use system prompts
    loops: list[list[int]] = []
    out = []
    for i in range(num_requests):
        if not loops or (len(loops) < 16 and rng.random() < 0.15):
            loops.append([*rng.choice(kinds), *ids.take(1)])  # the task
        j = rng.randrange(len(loops))
        history = loops[j]
        history.extend(ids.take(rng.randint(1, 3)))  # a tool's output
        out.append(_request(i, history, rng, rng.randint(32, 256)))
        history.extend(ids.take(1))  # the model's action
        if len(history) > 48 or rng.random() < 0.04:  # done: another task starts
            loops.pop(j)
    return out


def rag_trace(num_requests: int, seed: int = 0) -> list[Request]:
    """Questions over retrieved documents (see the module docstring)."""
    rng, ids = random.Random(seed), _Ids(2 * 10**9)
    system = ids.take(1)
    corpus = [ids.take(rng.randint(1, 3)) for _ in range(max(50, num_requests // 2))]
    weights = [1 / (rank + 1) ** 0.9 for rank in range(len(corpus))]
    last: list[int] | None = None
    out = []
    for i in range(num_requests):
        if last is not None and rng.random() < 0.25:  # a follow-up on the same documents
            blocks = [*last, *ids.take(1)]
        else:
            docs: list[int] = []
            for d in rng.choices(range(len(corpus)), weights, k=rng.randint(3, 6)):
                if corpus[d][0] not in docs:
                    docs.extend(corpus[d])
            blocks = [*system, *docs, *ids.take(1)]
        out.append(_request(i, blocks, rng, rng.randint(64, 512)))
        last = blocks
    return out


def mixed_trace(num_requests: int, seed: int = 0) -> list[Request]:
    """Chat, agent and RAG requests interleaved, 40/30/30."""
    rng = random.Random(seed)
    kinds = rng.choices(("chat", "agent", "rag"), (0.4, 0.3, 0.3), k=num_requests)
    parts = {
        "chat": iter(synthetic_trace(kinds.count("chat"), seed)),
        "agent": iter(agent_trace(kinds.count("agent"), seed + 1)),
        "rag": iter(rag_trace(kinds.count("rag"), seed + 2)),
    }
    out = []
    for i, kind in enumerate(kinds):
        r = next(parts[kind])
        out.append(Request(i * 100, r.input_length, r.output_length, r.hash_ids))
    return out


WORKLOADS: dict[str, Callable[[int, int], list[Request]]] = {
    "chat": synthetic_trace,
    "agent": agent_trace,
    "rag": rag_trace,
    "mixed": mixed_trace,
}


def generated(kind: str, num_requests: int, seed: int = 0) -> list[Request]:
    """A generated trace of ``kind`` (one of ``WORKLOADS``)."""
    make = WORKLOADS.get(kind)
    if make is None:
        raise InvalidInput(f"--workload {kind!r} is refused: allowed are {', '.join(WORKLOADS)}")
    return make(num_requests, seed)
