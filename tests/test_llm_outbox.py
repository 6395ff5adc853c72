"""NAME_llm's outbox (the thread that makes the engine's calls into Triton), outside Triton: the python backend's
module is a small fake here; the model itself is tested on a real Triton in test_llm_hostile.py and
test_llm_attacks.py."""

from __future__ import annotations

import threading
import time
import types

import pytest

from llmlib import llm_module


@pytest.fixture
def llm(monkeypatch):
    return llm_module(monkeypatch)


def test_the_engine_never_runs_more_than_its_steps_ahead_of_the_outbox(llm):
    """Unbounded, a fast engine ran far ahead of slow round trips to Triton: its queue grew without end, and a short
    sequence could end before its client's hang-up was seen (the work was never cancelled)."""
    delivered: list[int] = []
    outbox = llm.Outbox({}, lambda ids: None)
    behind = []
    for step in range(20):
        outbox.post(lambda step=step: (time.sleep(0.01), delivered.append(step)))
        outbox.end_step()  # returns once the outbox is at most AHEAD_STEPS steps behind
        behind.append(step + 1 - len(delivered))
    outbox.close()
    assert delivered == list(range(20))  # in order, every one
    assert max(behind) <= llm.AHEAD_STEPS, behind


def test_a_call_that_fails_stops_neither_the_outbox_nor_the_engine(llm):
    outbox = llm.Outbox({}, lambda ids: None)
    done = threading.Event()
    for _ in range(llm.AHEAD_STEPS + 2):
        outbox.post(lambda: 1 / 0)
        outbox.end_step()
    outbox.post(done.set)
    outbox.close()
    assert done.is_set()


def test_the_outbox_hands_over_the_requests_whose_client_has_gone(llm, monkeypatch):
    monkeypatch.setattr(llm, "CANCEL_POLL_S", 0.01)
    gone = threading.Event()
    found: list[str] = []

    class Sender:
        def __init__(self, cancelled: bool):
            self.cancelled = cancelled

        def is_cancelled(self) -> bool:
            return self.cancelled

    streams = {"a": types.SimpleNamespace(sender=Sender(False)), "b": types.SimpleNamespace(sender=Sender(True))}
    outbox = llm.Outbox(streams, lambda ids: (found.extend(ids), gone.set()))
    assert gone.wait(5)
    outbox.close()
    assert set(found) == {"b"}
