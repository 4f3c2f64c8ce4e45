"""DataParallelEngine's routing rule without processes: a shared prefix follows the replica it
went to unless that one carries `_OVERLOAD` more requests than the least loaded; short prompts
and dead replicas go by load."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest

from pagoda.engine import data_parallel as dp
from pagoda.engine.async_engine import EngineDeadError
from pagoda.engine.input_processor import ProcessedPrompt
from pagoda.sampling_params import SamplingParams


class _Replica:
    def __init__(self, load: int) -> None:
        self._streams = dict.fromkeys(range(load))
        self.is_running = True


def _engine(*loads: int) -> dp.DataParallelEngine:
    engine = dp.DataParallelEngine.__new__(dp.DataParallelEngine)
    engine.replicas = [_Replica(n) for n in loads]
    engine._lock = threading.Lock()
    engine._prefix_owner = OrderedDict()
    engine._prefix_tokens = 32
    engine.routed = [0] * len(loads)
    engine._pending = [0] * len(loads)
    engine.prefix_routed = 0
    return engine


def _items(ids: list[int]) -> list:
    return [(ProcessedPrompt(None, ids), SamplingParams())]


def test_prefix_follows_its_replica_until_overloaded() -> None:
    engine = _engine(3, 0)
    shared = list(range(40))
    assert engine._choose(_items(shared + [1])) == 1  # least loaded
    engine.replicas[1]._streams = dict.fromkeys(range(5))  # now busier than replica 0
    assert engine._choose(_items(shared + [2])) == 1  # follows the cached prefix
    assert engine.prefix_routed == 1
    engine.replicas[1]._streams = dict.fromkeys(range(3 + dp._OVERLOAD))
    assert engine._choose(_items(shared + [3])) == 0  # overloaded: by load, and re-owned
    engine.replicas[1]._streams = {}
    assert engine._choose(_items(shared + [4])) == 0


def test_short_prompts_and_dead_replicas_go_by_load() -> None:
    engine = _engine(2, 1)
    assert engine._choose(_items([1, 2, 3])) == 1
    assert dp._prompt_key(ProcessedPrompt(None, [1, 2, 3]), 32) is None
    engine.replicas[1].is_running = False
    assert engine._choose(_items([1, 2, 3])) == 0
    assert engine.dead_replicas() == [1]
    engine.replicas[0].is_running = False
    with pytest.raises(EngineDeadError, match="no data-parallel replica is running"):
        engine._choose(_items([1]))


def test_calls_still_being_added_count_as_load() -> None:
    """Concurrent arrivals: each is routed before the previous one's streams exist on its
    replica; counting the routed-but-not-added calls spreads them instead of sending all to
    the replica that looked idle (as a burst of 4 did, all to replica 0)."""
    engine = _engine(0, 0)
    assert [engine._choose(_items([i])) for i in range(4)] == [0, 1, 0, 1]
    assert engine.loads() == [2, 2]

    async def add(_make, _ids):  # the replica's own _add: streams registered, then returned
        return []

    import asyncio

    engine.replicas[0]._add = add
    engine._live = lambda: engine.replicas

    async def run(frontend_call):
        return frontend_call(None)

    engine.replicas[0].run = run
    asyncio.run(engine._add(lambda _frontend: _items([9]), lambda n: ["x"]))
    assert engine._pending == [2, 2]  # that call's own pending count was released


def test_size_is_checked() -> None:
    from pagoda.engine.args import EngineArgs

    with pytest.raises(ValueError, match="data_parallel_size must be >= 2"):
        dp.DataParallelEngine(EngineArgs(), 1)
