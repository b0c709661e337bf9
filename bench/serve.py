"""Throughput and latency of serve.py under concurrent clients, beside translate.py on the same sentences.

    python bench/serve.py --run runs/base                    # 1, 4 and 16 clients; requests of 1 and 16 sentences
    python bench/serve.py --run runs/base --clients 1 8 --per-request 1 --limit 200 --stalled 0

Starts `python serve.py --run RUN --port P` as a child process and waits for /health. Then, for each
number of sentences per request and each number of clients, that many client threads (standard
library http.client, one keep-alive connection each) take requests of the run's held-out test
sources (RUN/heldout/test.en) from one shared queue until every sentence has been translated once:
sentences/s over the whole pass, p50 and p99 request latency, and how many requests the server's
batcher served per translation call (from /health). Then one more pass, of the most clients and the
fewest sentences per request, beside --stalled connections (default 300) that send half a request and
then nothing (half of them stop in the request head, half in the body), each one the server closes
opened again at once, so that as many stall throughout. Then `python translate.py --run RUN --input FILE
--output OUT --quiet` on the same sentences, timed as a whole process, start-up included; and the
share of its translations identical to the server's. Prints one markdown table with the CPU, its
flags, the commit, the date and this command.

Run it on an otherwise idle machine: the server, the clients and translate.py share the CPU, and
anything else running skews every figure. Each pass starts with one warm-up request.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import math
import os
import queue
import selectors
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.checkpoints.rundir import RunDirectory  # noqa: E402
from transformer.hardware import cpu_flags, cpu_model  # noqa: E402
from transformer.serving.server import make_room_for_connections  # noqa: E402

HOST = "127.0.0.1"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


STALLED_HEAD = b"POST /translate HTTP/1.1\r\nHost: 127."
STALLED_BODY = (b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                b"content-length: 100\r\n\r\n{\"texts\": [")


@dataclass
class Pass:
    """One pass of all the sentences through the server."""

    clients: int
    per_request: int
    sentences: int
    seconds: float
    latencies: list[float]  # seconds, one per request
    calls: int  # the batcher's translation calls during the pass
    requests: int  # the requests they served
    outputs: list[str]  # the translations, in input order

    @property
    def sentences_per_second(self) -> float:
        return self.sentences / self.seconds


def read_sources(run: Path, limit: int) -> list[str]:
    """The run's held-out test sources, blank lines left out; the first `limit`."""
    found = RunDirectory(run).read_heldout("test")
    lines = [line for line in (found[0] if found else []) if line.strip()]
    lines = lines[:limit] if limit else lines
    if not lines:
        sys.exit(f"error: {run}: no held-out test sentences (heldout/test.*)")
    return lines


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def get_json(port: int, path: str, body: dict | None = None, connection: http.client.HTTPConnection | None = None
             ) -> dict:
    """GET `path`, or POST `body` as JSON; the answer's JSON, exiting on an error status."""
    own = connection is None
    connection = connection or http.client.HTTPConnection(HOST, port, timeout=600)
    try:
        if body is None:
            connection.request("GET", path)
        else:
            connection.request("POST", path, body=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
        response = connection.getresponse()
        answer = response.read()
        if response.status != 200:
            raise RuntimeError(f"{path}: HTTP {response.status}: {answer[:300]!r}")
        return json.loads(answer)
    finally:
        if own:
            connection.close()


def start_server(args: argparse.Namespace, port: int, log_file) -> tuple[subprocess.Popen, float]:
    """serve.py as a child process, and the seconds until /health answered."""
    command = [sys.executable, str(ROOT / "serve.py"), "--run", str(args.run), "--port", str(port),
               "--device", args.device, "--threads", str(args.threads)]
    command += [] if args.engine is None else ["--engine", args.engine]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    while True:
        if process.poll() is not None:
            log_file.seek(0)
            sys.exit(f"error: serve.py stopped (exit {process.returncode}):\n{log_file.read()[-2000:]}")
        try:
            get_json(port, "/health")
            return process, time.perf_counter() - start
        except (OSError, http.client.HTTPException):
            if time.perf_counter() - start > 300:
                process.terminate()
                sys.exit("error: serve.py did not answer /health within 300 s")
            time.sleep(0.2)


def run_pass(port: int, sentences: list[str], clients: int, per_request: int, options: dict) -> Pass:
    """All `sentences`, `per_request` at a time, sent by `clients` threads sharing one queue."""
    work: queue.Queue[tuple[int, list[str]]] = queue.Queue()
    for start in range(0, len(sentences), per_request):
        work.put((start, sentences[start: start + per_request]))
    outputs: list[str] = [""] * len(sentences)
    latencies: list[float] = []
    errors: list[BaseException] = []
    ready = threading.Barrier(clients + 1)

    def client() -> None:
        connection = http.client.HTTPConnection(HOST, port, timeout=600)
        try:
            ready.wait()
            while True:
                try:
                    start, texts = work.get_nowait()
                except queue.Empty:
                    return
                sent = time.perf_counter()
                answer = get_json(port, "/translate", {"texts": texts, **options}, connection)
                latencies.append(time.perf_counter() - sent)  # list.append is atomic
                for i, translation in enumerate(answer["translations"]):
                    outputs[start + i] = translation["translation"]
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)
        finally:
            connection.close()

    get_json(port, "/translate", {"texts": sentences[:per_request], **options})  # warm-up
    before = get_json(port, "/health")["batches"]
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    ready.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    after = get_json(port, "/health")["batches"]
    return Pass(clients, per_request, len(sentences), seconds, latencies, after["calls"] - before["calls"],
                after["requests"] - before["requests"], outputs)


class StalledClients:
    """`count` connections that each send half a request and then nothing (alternately half a head and
    a head with half a body), held by one thread while the block runs. When the server answers or closes
    one, it is closed and opened again, so that `count` stall throughout; `closed_by_server` counts them."""

    def __init__(self, port: int, count: int) -> None:
        self.port, self.count, self.closed_by_server = port, count, 0
        self._stop, self._ready = threading.Event(), threading.Event()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._hold, daemon=True)

    def __enter__(self) -> StalledClients:
        self._thread.start()
        self._ready.wait(timeout=120)
        if self._errors or not self._ready.is_set():
            self.__exit__()
            raise RuntimeError(f"could not open {self.count} stalled connections: {self._errors[:1]}")
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        if self._errors:
            raise self._errors[0]

    def _open(self, selector: selectors.BaseSelector, i: int) -> None:
        sock = socket.create_connection((HOST, self.port), timeout=30)
        sock.sendall(STALLED_BODY if i % 2 else STALLED_HEAD)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, i)

    def _hold(self) -> None:
        with selectors.DefaultSelector() as selector:
            try:
                for i in range(self.count):
                    self._open(selector, i)
                self._ready.set()
                while not self._stop.is_set():
                    for key, _ in selector.select(timeout=0.1):  # an answer (408, 503) or the server closed it
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
                        self.closed_by_server += 1
                        self._open(selector, key.data)
            except BaseException as error:  # noqa: BLE001 - raised by __exit__ in the main thread
                self._errors.append(error)
                self._ready.set()
            finally:
                for key in list(selector.get_map().values()):
                    key.fileobj.close()


def translate_py_arguments(args: argparse.Namespace, source: str, output: str) -> list[str]:
    """translate.py's arguments for translating the file `source` into `output`, with this run's options."""
    arguments = ["--run", str(args.run), "--input", source, "--output", output, "--quiet", "--device", args.device,
                 "--threads", str(args.threads)]
    arguments += [] if args.beam is None else ["--beam", str(args.beam)]
    return arguments + ([] if args.engine is None else ["--engine", args.engine])


def run_translate_py(args: argparse.Namespace, sentences: list[str]) -> tuple[float, list[str]]:
    """Wall seconds of one `translate.py` process over `sentences`, and its translations."""
    with tempfile.TemporaryDirectory() as tmp:
        source, output = Path(tmp) / "input.txt", Path(tmp) / "output.txt"
        source.write_text("".join(f"{s}\n" for s in sentences), encoding="utf-8")
        command = [sys.executable, str(ROOT / "translate.py"), *translate_py_arguments(args, str(source), str(output))]
        start = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            sys.exit(f"error: translate.py failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
        return seconds, output.read_text(encoding="utf-8").splitlines()


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile: the smallest value with at least `share` of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def cpu_description() -> tuple[str, str]:
    """The CPU's model name and which of CPU_FLAGS it has (Linux)."""
    present = [flag for flag in CPU_FLAGS if flag in cpu_flags()]
    return cpu_model(), ", ".join(present) or "none of " + ", ".join(CPU_FLAGS)


def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (" (with uncommitted changes)" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="the trained run to serve")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], metavar="N",
                        help="numbers of concurrent clients (default: 1 4 16)")
    parser.add_argument("--per-request", type=int, nargs="+", default=[1, 16], metavar="K",
                        help="sentences per request (default: 1 16; at most 64)")
    parser.add_argument("--limit", type=int, default=0, metavar="N", help="the first N test sentences (default: all)")
    parser.add_argument("--beam", type=int, help="beam size, for both (default: the run's)")
    parser.add_argument("--device", default="auto", help="for serve.py and translate.py (default: auto)")
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="CPU threads of serve.py and translate.py (default: one per core)")
    parser.add_argument("--engine", choices=["torch", "ctranslate2"],
                        help="the engine of serve.py's plain requests and of translate.py (default: theirs, "
                             "CTranslate2 where it imports)")
    parser.add_argument("--stalled", type=int, default=300, metavar="N",
                        help="stalled connections beside the working clients of the last pass (default: 300; "
                             "0: no such pass)")
    args = parser.parse_args()
    if any(n < 1 for n in args.clients) or any(not 1 <= k <= 64 for k in args.per_request) or args.stalled < 0:
        parser.error("--clients must be 1 or more, --per-request between 1 and 64, --stalled 0 or more")
    make_room_for_connections(args.stalled + max(args.clients))
    sentences = read_sources(args.run, args.limit)
    options = {} if args.beam is None else {"beam": args.beam}

    port = free_port()
    beside_stalled, stalled = None, None
    with tempfile.TemporaryFile("w+", encoding="utf-8") as log_file:
        process, startup = start_server(args, port, log_file)
        try:
            passes = [run_pass(port, sentences, clients, per_request, options)
                      for per_request in args.per_request for clients in args.clients]
            if args.stalled:
                with StalledClients(port, args.stalled) as stalled:
                    beside_stalled = run_pass(port, sentences, max(args.clients), min(args.per_request), options)
            health = get_json(port, "/health")
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    seconds, translated = run_translate_py(args, sentences)

    cpu, flags = cpu_description()
    served = passes[0].outputs
    same = sum(a == b for a, b in zip(served, translated)) / len(sentences)
    print(f"CPU: {cpu} ({os.cpu_count()} logical cores; flags: {flags})  ")
    print(f"commit {git_commit()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  ")
    print(f"`{shlex.join(['python', *sys.argv])}`  ")
    print(f"{len(sentences)} test sentences of {args.run}, beam {health['beam']} (served by {health['engine']}, "
          f"checkpoint {health['checkpoint']}); serve.py answered /health {startup:.1f} s after its start\n")
    print("| | clients | sentences / request | sentences/s | p50 latency (ms) | p99 latency (ms) | requests per call |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = [("serve.py", p) for p in passes]
    if beside_stalled is not None:
        rows.append((f"serve.py, {args.stalled} stalled connections beside", beside_stalled))
    for name, p in rows:
        print(f"| {name} | {p.clients} | {p.per_request} | {p.sentences_per_second:.1f} | "
              f"{1000 * statistics.median(p.latencies):.0f} | {1000 * percentile(p.latencies, 0.99):.0f} | "
              f"{p.requests / max(p.calls, 1):.1f} |")
    print(f"| translate.py, one process, start-up included | – | all | {len(sentences) / seconds:.1f} "
          "| – | – | – |")
    shown = shlex.join(["python", "translate.py", *translate_py_arguments(args, "SENTENCES", "OUT")])
    print(f"\ntranslate.py: `{shown}` ({seconds:.1f} s); its translations equal the server's (first pass) "
          f"for {same:.1%} of the sentences.")
    if beside_stalled is not None:
        print(f"Stalled connections: {args.stalled} held open through their pass ({beside_stalled.seconds:.1f} s), "
              f"half in the request head and half in the body; the server answered or closed "
              f"{stalled.closed_by_server} of them, each opened again at once.")


if __name__ == "__main__":
    main()
