"""Batching across requests: callers `submit` their texts with their decode options and get a future;
one worker thread takes the oldest waiting request, gathers the others waiting (and those arriving
within a short window), and runs each group of identical options as one call of a work function,
handing every request its own slice of the results; `stop` answers every request still unanswered at
once, without waiting for the call in progress (a server told to stop). No HTTP here (app.py is the server), and no
engine either: the work function translates.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Options = TypeVar("Options", bound=Hashable)
Result = TypeVar("Result")


class Stopped(RuntimeError):
    """The batcher was stopped (or closed) before this request's results: they will never come."""


@dataclass(frozen=True)
class BatchRecord:
    """One call of the work function: how many requests and texts it served together."""

    requests: int
    texts: int


@dataclass(frozen=True)
class Served:
    """Every call so far: how many, and the requests and texts they served. Replaced whole after each
    call, so that another thread reads a consistent triple."""

    calls: int = 0
    requests: int = 0
    texts: int = 0


@dataclass
class _Request(Generic[Options, Result]):
    options: Options
    texts: list[str]
    future: Future
    arrived: float  # time.monotonic()


class Batcher(Generic[Options, Result]):
    """Runs `work(options, texts) -> one result per text` on one worker thread, for many callers. A
    "text" is whatever the work function takes (app.py: a text and its target prefix); the batcher
    only counts them.

    Why one thread: a model and its caches are not thread-safe, and a batch of sentences costs far
    less than the same sentences one at a time. `window` (seconds): how long after the oldest waiting
    request arrived the worker still waits for others before it starts (0: take what is waiting);
    `max_texts`: the most texts of one call (a single larger request still runs, alone).

    A request's results are those the work function gives its texts among the others; for them to be
    what the request would get alone, the work function must not depend on what it is batched with
    (texts.translate_texts: padding changes no output). When a call with several requests raises,
    each of them runs again alone, so that an error reaches only the request that caused it.
    """

    def __init__(self, work: Callable[[Options, list[str]], Sequence[Result]], max_texts: int = 256,
                 window: float = 0.005, history: int = 1000, name: str = "batcher") -> None:
        if max_texts < 1:
            raise ValueError(f"max_texts must be at least 1, got {max_texts}")
        if window < 0:
            raise ValueError(f"window must be 0 or more seconds, got {window}")
        self.work, self.max_texts, self.window = work, max_texts, window
        self.batches: deque[BatchRecord] = deque(maxlen=history)  # the latest calls, oldest first
        self.served = Served()
        self._pending: deque[_Request] = deque()
        self._condition = threading.Condition()
        self._closing = False
        self._taken: list[_Request] = []  # the requests of the worker's current round (for `stop`)
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, options: Options, texts: list[str]) -> Future:
        """A future of the results of `texts` (a list, one per text, in order) under `options`, or of
        the exception their work raised. Cancelling it before its batch starts skips its texts."""
        future: Future = Future()
        if not texts:
            future.set_result([])
            return future
        with self._condition:
            if self._closing:
                raise Stopped("the batcher is closed")
            self._pending.append(_Request(options, list(texts), future, time.monotonic()))
            self._condition.notify()
        return future

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish those already waiting, and stop the worker."""
        with self._condition:
            self._closing = True
            self._condition.notify()
        self._thread.join(timeout)

    def stop(self, wait: float = 0.0) -> None:
        """Refuse new requests, and fail every request not yet answered, those waiting and those of the call
        in progress, with Stopped, now: a call cannot be stopped from outside, and one over long texts may
        take minutes. The worker ends once that call returns (its results are dropped); `wait`: seconds to
        wait for it (it is a daemon thread, which does not keep the process alive)."""
        with self._condition:
            self._closing = True
            self._stopped = True
            unanswered = [*self._pending, *self._taken]
            self._pending.clear()
            self._condition.notify()
        for request in unanswered:
            _settle(request.future, error=Stopped("the batcher stopped before these texts were translated"))
        self._thread.join(wait)

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ------------------------------------------------------------------ the worker thread

    def _serve(self) -> None:
        while True:
            groups = self._gather()
            if groups is None:
                return
            for options, requests in groups.items():
                if self._stopped:  # `stop` answered them
                    break
                self._run(options, requests)
            with self._condition:
                self._taken = []

    def _gather(self) -> dict[Options, list[_Request]] | None:
        """The next requests to run, grouped by options in order of their oldest request (each group at
        most max_texts texts, unless one request alone has more); None once closed and drained."""
        with self._condition:
            while not self._pending and not self._closing:
                self._condition.wait()
            if not self._pending:
                return None
            # The window counts from the oldest request's arrival: one that already waited while the
            # worker was busy waits no longer, and the others have gathered behind it meanwhile.
            deadline = self._pending[0].arrived + self.window
            while not self._closing and sum(len(r.texts) for r in self._pending) < self.max_texts:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._condition.wait(left)
            groups: dict[Options, list[_Request]] = {}
            sizes: dict[Options, int] = {}
            rest: deque[_Request] = deque()
            for request in self._pending:
                size = sizes.get(request.options, 0)
                if size and size + len(request.texts) > self.max_texts:
                    rest.append(request)  # the next round's, still in arrival order
                    continue
                groups.setdefault(request.options, []).append(request)
                sizes[request.options] = size + len(request.texts)
            self._pending = rest
            self._taken = [request for requests in groups.values() for request in requests]
        # A caller that gave up (a cancelled future) costs nothing more.
        groups = {options: [r for r in requests if _started(r.future)]
                  for options, requests in groups.items()}
        return {options: requests for options, requests in groups.items() if requests}

    def _run(self, options: Options, requests: list[_Request]) -> None:
        texts = [text for request in requests for text in request.texts]
        try:
            results = list(self.work(options, texts))
            if len(results) != len(texts):
                raise RuntimeError(f"the work function gave {len(results)} results for {len(texts)} texts")
        except Exception as error:  # noqa: BLE001 - handed to the caller(s), never lost
            if len(requests) > 1:
                for request in requests:
                    self._run(options, [request])
            else:
                _settle(requests[0].future, error=error)
            return
        self.batches.append(BatchRecord(len(requests), len(texts)))
        served = self.served
        self.served = Served(served.calls + 1, served.requests + len(requests), served.texts + len(texts))
        start = 0
        for request in requests:
            _settle(request.future, results[start: start + len(request.texts)])
            start += len(request.texts)


def _started(future: Future) -> bool:
    """Mark `future` running; False when its caller cancelled it or `stop` already answered it."""
    try:
        return future.set_running_or_notify_cancel()
    except RuntimeError:  # finished: `stop` failed it
        return False


def _settle(future: Future, result: object = None, error: BaseException | None = None) -> None:
    """Give `future` its result or exception, unless `stop` already failed it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


__all__ = ["Batcher", "BatchRecord", "Served", "Stopped"]
