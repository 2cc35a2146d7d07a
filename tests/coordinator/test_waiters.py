"""One future per call (``fabric.coordinator.waiters``)."""

import asyncio

from fabric.coordinator.requests import RequestResult
from fabric.coordinator.waiters import Waiters


def test_a_call_resolves_with_its_last_result_in_the_order_asked():
    async def go():
        w = Waiters()
        many, one = w.wait(["a", "b", "c"]), w.wait(["d"])
        w.deliver(RequestResult("c", 3))
        w.deliver(RequestResult("stranger", 9))  # nobody waits: ignored
        w.deliver(RequestResult("a", 1))
        assert not many.done() and len(w) == 2
        w.deliver(RequestResult("b", 2))
        w.deliver(RequestResult("b", 7))  # delivered twice: the first stands
        return await many, one, w

    results, one, w = asyncio.run(go())
    assert [(r.request_id, r.prompt_tokens) for r in results] == [("a", 1), ("b", 2), ("c", 3)]
    assert not one.done() and len(w) == 1


def test_failing_all_answers_every_call_with_the_error():
    async def go():
        w = Waiters()
        first, second = w.wait(["a", "b"]), w.wait(["c"])
        w.deliver(RequestResult("a", 1))
        w.fail_all("coordinator failed")
        return await first, await second, len(w)

    first, second, left = asyncio.run(go())
    assert [r.error for r in first] == [None, "coordinator failed"]
    assert [r.error for r in second] == ["coordinator failed"]
    assert left == 0
