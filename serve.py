"""Serve a trained run over HTTP: a JSON API and a web page that translates as you type.

  python serve.py --run runs/base                  # http://127.0.0.1:8000/ ; API docs at /docs
  curl -s 127.0.0.1:8000/translate -H 'content-type: application/json' \\
       -d '{"texts": ["I am cold."], "n_best": 2, "alignment": true}'

Needs the serve extra: pip install -e ".[serve]". The port is taken first, then the model loads, then
the server answers: a port in use or a run that cannot be loaded stops here with one error line. Engines
as in translate.py: plain requests run on CTranslate2 where it imports (--engine auto, exported into the
run on first use), requests with "alignment" or "sampling" on the torch engine, which alone returns the
attention the page draws and draws the same samples for the same seed, and so does POST /explain, the
search of one sentence step by step that the page shows beside the attention.

Requests whose Host is not 127.0.0.1, localhost, [::1], the --host address or an --allow-host name get
400: a web page elsewhere cannot reach the server by pointing a name of its own at this machine (DNS
rebinding). Clients that stall hold nothing for long: at most 1,000 connections (fewer where the limit on
open files found at start-up leaves less room, as the log line says), 10 s for a request's head and 30 s
for its body, and when the server is full, a client silent for a second gives its place to a new one. A
request held to phrases (constraints, avoid) whose search would cost more than --max-search-cost gets 413
(docs/serving.md says how the cost is counted).
Ctrl-C or SIGTERM stops it within a couple of seconds, also in the middle of a long translation, whose
request gets 503. Exit codes: 2 a problem with the input or the system, said in one line; 130 stopped by
Ctrl-C; 143 stopped by SIGTERM (what `timeout`, systemd and `docker stop` send); 129 by SIGHUP (the terminal
or ssh session closed; `nohup` keeps it serving).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import sys

from transformer.hardware import openmp_wait_setting
from transformer.cli import StopSignals, guard_standard_streams, path_argument, run_script, stop_signals
from transformer.errors import UserError, name_options
from transformer.serving.cost import MAX_SEARCH_COST
from transformer.training.logs import setup_logging

FLAGS = {"engine": "--engine", "device": "--device", "threads": "--threads", "run": "--run",  # the package's names
         "checkpoint": "--checkpoint"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--run", type=path_argument, help="run directory (default: the newest run under runs/)")
    where.add_argument("--checkpoint", type=path_argument,
                       help="a checkpoint directory, e.g. runs/base/checkpoints/best")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000; 0: a free one)")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="a Host name to answer besides 127.0.0.1, localhost, [::1] and --host's address, "
                             "e.g. the machine's name on your network (repeatable; *.example.org for its "
                             "subdomains, * for any); requests naming others get 400")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    parser.add_argument("--threads", type=int, default=0, metavar="N", help="CPU threads (default: one per core)")
    parser.add_argument("--engine", choices=["auto", "ctranslate2", "torch"], default="auto",
                        help="the engine of plain requests: auto (default) is CTranslate2 where it is installed, "
                             "else torch; alignment and sampling requests always run on torch")
    parser.add_argument("--max-search-cost", type=int, default=MAX_SEARCH_COST, metavar="N",
                        help="the most a request held to phrases may cost: beam x (phrases + 1) x the sum of its "
                             "texts' output-length limits in subwords; a costlier one gets 413 "
                             f"(default: {MAX_SEARCH_COST:,})")
    return parser.parse_args(argv)


def answered_hosts(args: argparse.Namespace) -> list[str]:
    """The Host names the server answers to: the local ones, the address it listens on (unless that is
    every address), and --allow-host's."""
    from transformer.serving.app import LOCAL_HOSTS, allowed_host

    own = [] if args.host in ("", "0.0.0.0", "::") else [("--host", args.host)]
    names = list(LOCAL_HOSTS)
    for flag, name in [*own, *(("--allow-host", name) for name in args.allow_host)]:
        try:
            names.append(allowed_host(name))
        except ValueError as error:
            raise UserError(f"{flag}: {error}") from None
    return list(dict.fromkeys(names))


def listen(host: str, port: int):
    """The listening socket, taken before the model loads."""
    from transformer.serving.server import listen as open_socket

    if not 0 <= port <= 65535:
        raise UserError(f"--port must be between 0 and 65535, got {port}")
    try:
        return open_socket(host, port)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise UserError(f"--port {port}: the port is in use on {host} (another serve.py?); "
                            "choose another with --port N, or --port 0 for any free one") from None
        raise UserError(f"--host {host} --port {port}: cannot listen there ({error.strerror or error})") from None


def import_ctranslate2_before_torch() -> None:
    """Import CTranslate2 before anything imports torch. Both wheels bundle an OpenMP runtime (libgomp);
    imported after torch, CTranslate2's library binds to torch's copy, and with both engines' thread
    pools counted by one runtime there are more OpenMP threads than cores, so libgomp stops spinning and
    sleeps at every barrier: CTranslate2 then runs several times slower whenever the torch engine
    has run once (`python bench/one_process.py` measures both orders). Imported first, each engine
    keeps its own runtime. (How idle threads wait, hardware.OPENMP_WAIT, is set for both runtimes alike
    before either loads; the order decides whether there are two.)"""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        pass  # the engine policy says what that means


def run(args: argparse.Namespace) -> None:
    if args.engine != "torch":
        import_ctranslate2_before_torch()
    # Then torch's OpenMP threads sleep rather than spin while idle (unless the environment says how they
    # wait): spinning, they take the cores from the server's own work whenever other processes use the
    # machine too (hardware.OPENMP_WAIT says why). CTranslate2's runtime, loaded above, keeps spinning: its
    # many short parallel regions run several times slower when its threads sleep between them.
    if (wait := openmp_wait_setting(os.environ)) is not None:
        os.environ[wait[0]] = wait[1]
    try:
        from transformer.serving.app import ServerCaps, create_app, stop_translating
        from transformer.serving.server import build_server, limits_for_open_files
    except ImportError as error:
        if (error.name or "").partition(".")[0] not in ("fastapi", "uvicorn", "starlette", "h11", "pydantic"):
            raise  # torch (the server loads the torch engine whatever serves plain requests): the boundary's line
        raise UserError(f"serving needs FastAPI and uvicorn ({error.name} is missing): "
                        "pip install -e \".[serve]\"") from None
    if args.max_search_cost < 1:
        raise UserError(f"--max-search-cost must be at least 1, got {args.max_search_cost}")
    caps = ServerCaps(search_cost=args.max_search_cost)
    with listen(args.host, args.port) as sock:  # before the model loads: a port in use costs no wait
        from transformer.engines import EngineRequest, open_server_engines

        hosts = answered_hosts(args)
        translator, engine, notes = open_server_engines(EngineRequest(args.engine, args.run, args.checkpoint,
                                                                      device=args.device, threads=args.threads))
        for note in notes:
            logging.info("%s", name_options(note, FLAGS))
        app = create_app(engine, torch_engine=translator,  # attention and seeded samples: torch
                         allowed_hosts=hosts, caps=caps)
        limits = limits_for_open_files()  # now that the model's files are open
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
        files = f" (open-file limit {limits.open_files})" if limits.open_files else ""
        logging.info("serving %s (the page) and %sdocs (the API) to Host %s; at most %d connections%s", url, url,
                     ", ".join(hosts), limits.max_connections, files)
        # uvicorn logs each request on standard output: started without one (`>&-`), the server logs none.
        requests_logged = sys.stdout is not None and not sys.stdout.closed
        # Ctrl-C, SIGTERM or SIGHUP: requests still unanswered get 503 at once, the server stops, and raises the
        # signal again for StopSignals (main) to say so.
        build_server(app, limits, access_log=requests_logged, on_stop=lambda: stop_translating(app),
                     signals=stop_signals()).run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(level=logging.INFO)

    def stoppable() -> None:  # SIGTERM (`timeout`, systemd, `docker stop`), SIGHUP as Ctrl-C, while loading too
        with StopSignals():
            run(args)

    return run_script(stoppable, sys.stderr, sys.argv[1:] if argv is None else argv, names=FLAGS)


def end_process(code: int) -> None:
    """End the process with `code` at once, its logs and streams flushed. A translation the worker thread is in
    the middle of when the server stops cannot be stopped from outside, and the interpreter's own exit would
    tear torch down under it: the C++ runtime aborts (SIGABRT), which is neither the exit code nor a clean
    end. os._exit skips that teardown; nothing of the server's is left to finish by then."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or departed stream has nothing left to say
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    guard_standard_streams()
    end_process(main())
