"""CUDA graph capture's care around Python's garbage collector, checked without a GPU: torch.cuda's
capture calls are stood in for, and the captured forward records what it sees."""
from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from forge_service.backends.cuda import graphs


@pytest.fixture
def fake_capture(monkeypatch):
    """torch.cuda's graph calls as no-ops; the returned list says, per forward call, whether a
    capture was open and whether the collector could run."""
    state = {"capturing": False}

    @contextlib.contextmanager
    def graph(_graph, pool=None):
        state["capturing"] = True
        try:
            yield
        finally:
            state["capturing"] = False

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    was = gc.isenabled()
    gc.enable()
    yield state
    if not was:
        gc.disable()


def test_the_collector_never_runs_while_a_graph_is_captured(fake_capture):
    """Collecting an engine that went out of use destroys its CUDA graphs, which a capturing
    stream refuses: the capture of a second engine's graphs then fails."""
    seen = []

    def forward(ids, positions, meta, rows):
        seen.append((fake_capture["capturing"], gc.isenabled()))
        return torch.zeros(ids.shape[0], 4)

    decode = graphs.DecodeGraphs(forward, torch.device("cpu"), 16, 4, 64)
    decode.capture([1, 2, 4])
    assert [capturing for capturing, _ in seen] == [False, True] * 3  # a warm-up, then the capture
    assert not any(collecting for capturing, collecting in seen if capturing)
    assert gc.isenabled() and sorted(decode.graphs) == [1, 2, 4]


def test_a_failed_capture_lets_the_collector_run_again(fake_capture):
    def forward(ids, positions, meta, rows):
        if fake_capture["capturing"]:
            raise RuntimeError("capture failed")
        return torch.zeros(ids.shape[0], 4)

    with pytest.raises(RuntimeError, match="capture failed"):
        graphs.DecodeGraphs(forward, torch.device("cpu"), 16, 2, 64).capture([1, 2])
    assert gc.isenabled()
