"""transformer/serving/batcher.py with a scripted work function: requests waiting together run in one
call per option set, each gets its own slice in order, the size limit and the window hold, an error
reaches only its own request, a cancelled request is skipped, close() finishes what waits, and stop()
answers what is unanswered at once."""

from __future__ import annotations

import threading
import time

import pytest

from transformer.serving.batcher import Batcher, BatchRecord, Served, Stopped


class Work:
    """Upper-cases texts, recording each call; the first call waits for `release`, so that the
    requests submitted meanwhile queue up behind it. A text "bad" raises."""

    def __init__(self, hold_first: bool = True) -> None:
        self.calls: list[tuple[object, list[str]]] = []
        self.started, self.release = threading.Event(), threading.Event()
        if not hold_first:
            self.release.set()

    def __call__(self, options, texts: list[str]) -> list[str]:
        self.calls.append((options, list(texts)))
        self.started.set()
        assert self.release.wait(10)
        if "bad" in texts:
            raise ValueError("bad text")
        return [f"{options}:{text.upper()}" for text in texts]


def held(work: Work, batcher: Batcher) -> None:
    """Occupy the worker with one request until work.release is set."""
    batcher.submit("hold", ["first"])
    assert work.started.wait(10)


def test_waiting_requests_run_together_each_getting_its_own_slice():
    work = Work()
    with Batcher(work, max_texts=100, window=0) as batcher:
        held(work, batcher)
        futures = [batcher.submit("a", ["x", "y"]), batcher.submit("b", ["z"]), batcher.submit("a", ["w"]),
                   batcher.submit("a", [])]
        work.release.set()
        assert [f.result(10) for f in futures] == [["a:X", "a:Y"], ["b:Z"], ["a:W"], []]
    # One call per option set, in order of each set's oldest request; the empty request ran nothing.
    assert work.calls == [("hold", ["first"]), ("a", ["x", "y", "w"]), ("b", ["z"])]
    assert list(batcher.batches) == [BatchRecord(1, 1), BatchRecord(2, 3), BatchRecord(1, 1)]
    assert batcher.served == Served(calls=3, requests=4, texts=5)


def test_a_call_holds_at_most_max_texts_unless_one_request_alone_has_more():
    work = Work()
    with Batcher(work, max_texts=3, window=0) as batcher:
        held(work, batcher)
        futures = [batcher.submit("a", ["1", "2"]), batcher.submit("a", ["3", "4"]), batcher.submit("a", ["5"]),
                   batcher.submit("a", ["6", "7", "8", "9"])]
        work.release.set()
        assert [len(f.result(10)) for f in futures] == [2, 2, 1, 4]
    assert [texts for _, texts in work.calls[1:]] == [["1", "2", "5"], ["3", "4"], ["6", "7", "8", "9"]]


def test_the_window_gathers_requests_arriving_soon_after_the_first():
    work = Work(hold_first=False)
    # A window far longer than any pause between the two submissions, ended by max_texts rather
    # than by the clock: the worker waits in it for the second request, however slow the machine.
    with Batcher(work, max_texts=2, window=60) as batcher:
        first = batcher.submit("a", ["x"])
        time.sleep(0.05)  # lets the worker reach the window's wait first
        second = batcher.submit("a", ["y"])
        assert first.result(10) == ["a:X"] and second.result(10) == ["a:Y"]
    assert work.calls == [("a", ["x", "y"])]


def test_an_error_reaches_only_the_request_that_caused_it():
    work = Work()
    with Batcher(work, window=0) as batcher:
        held(work, batcher)
        good, bad, other = batcher.submit("a", ["x"]), batcher.submit("a", ["bad"]), batcher.submit("a", ["y"])
        work.release.set()
        assert good.result(10) == ["a:X"] and other.result(10) == ["a:Y"]
        with pytest.raises(ValueError, match="bad text"):
            bad.result(10)
        assert batcher.submit("a", ["z"]).result(10) == ["a:Z"]  # the worker goes on
    # Together first; after the error, each request alone.
    assert [texts for _, texts in work.calls[1:4]] == [["x", "bad", "y"], ["x"], ["bad"]]


def test_a_cancelled_request_is_skipped():
    work = Work()
    with Batcher(work, window=0) as batcher:
        held(work, batcher)
        gone, kept = batcher.submit("a", ["gone"]), batcher.submit("a", ["kept"])
        assert gone.cancel()
        work.release.set()
        assert kept.result(10) == ["a:KEPT"]
    assert all("gone" not in texts for _, texts in work.calls)


def test_close_finishes_the_waiting_requests_then_refuses_new_ones():
    work = Work()
    batcher = Batcher(work, window=0)
    held(work, batcher)
    waiting = batcher.submit("a", ["x"])
    threading.Timer(0.1, work.release.set).start()
    batcher.close(timeout=10)
    assert waiting.result(0) == ["a:X"]
    assert not batcher._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit("a", ["y"])


def test_stop_answers_the_call_in_progress_and_the_waiting_requests_at_once():
    """A server told to stop cannot wait for a translation of minutes (issue 58): every unanswered request
    fails with Stopped now; the worker drops the results of its call when it returns, and runs nothing more."""
    work = Work()
    batcher = Batcher(work, window=60, max_texts=2)
    running, taken = batcher.submit("a", ["x"]), batcher.submit("b", ["y"])  # one round: "a" runs, "b" is next
    assert work.started.wait(10)
    waiting = batcher.submit("a", ["z"])
    started = time.monotonic()
    batcher.stop()
    assert time.monotonic() - started < 1
    for future in (running, taken, waiting):
        with pytest.raises(Stopped):
            future.result(0)
    with pytest.raises(Stopped):
        batcher.submit("a", ["w"])
    assert batcher._thread.is_alive()  # still in its call
    work.release.set()
    batcher._thread.join(10)
    assert not batcher._thread.is_alive() and work.calls == [("a", ["x"])]


def test_wrong_settings_are_refused():
    with pytest.raises(ValueError, match="max_texts"):
        Batcher(Work(), max_texts=0)
    with pytest.raises(ValueError, match="window"):
        Batcher(Work(), window=-1)
