"""Serve a trained run over HTTP: a JSON API and a web page that translates as you type.

  python serve.py --run runs/base                  # http://127.0.0.1:8000/ ; API docs at /docs
  curl -s 127.0.0.1:8000/translate -H 'content-type: application/json' \\
       -d '{"texts": ["I am cold."], "n_best": 2, "alignment": true}'

Needs the serve extra: pip install -e ".[serve]". The model loads before the server listens: a run
that cannot be loaded stops here with one error line. Engines as in translate.py: plain requests run
on CTranslate2 where it imports (--engine auto, exported into the run on first use), requests with
"alignment" or "sampling" on the torch engine, which alone returns the attention the page draws and
draws the same samples for the same seed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from transformer.errors import UserError, name_options
from transformer.training.logs import setup_logging

FLAGS = {"engine": "--engine", "device": "--device", "threads": "--threads", "run": "--run"}  # the package's names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--run", type=Path, help="run directory (default: the newest run under runs/)")
    where.add_argument("--checkpoint", type=Path, help="a checkpoint directory, e.g. runs/base/checkpoints/best")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    parser.add_argument("--threads", type=int, default=0, metavar="N", help="CPU threads (default: one per core)")
    parser.add_argument("--engine", choices=["auto", "ctranslate2", "torch"], default="auto",
                        help="the engine of plain requests: auto (default) is CTranslate2 where it is installed, "
                             "else torch; alignment and sampling requests always run on torch")
    return parser.parse_args(argv)


def import_ctranslate2_before_torch() -> None:
    """Import CTranslate2 before anything imports torch. Both wheels bundle an OpenMP runtime (libgomp);
    imported after torch, CTranslate2's library binds to torch's copy, and with both engines' thread
    pools counted by one runtime there are more OpenMP threads than cores, so libgomp stops spinning and
    sleeps at every barrier: CTranslate2 then runs several times slower whenever the torch engine
    has run once (`python bench/one_process.py` measures both orders). Imported first, each engine
    keeps its own runtime."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        pass  # the engine policy says what that means


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(level=logging.INFO)
    if args.engine != "torch":
        import_ctranslate2_before_torch()
    try:
        try:
            import uvicorn

            from transformer.serving.app import create_app
        except ImportError as error:
            raise UserError(f"serving needs FastAPI and uvicorn ({error.name} is missing): "
                            "pip install -e \".[serve]\"") from None
        from transformer.engines import EngineRequest, open_server_engines

        translator, engine, notes = open_server_engines(EngineRequest(args.engine, args.run, args.checkpoint,
                                                                      device=args.device, threads=args.threads))
        for note in notes:
            logging.info("%s", name_options(note, FLAGS))
        app = create_app(engine, torch_engine=translator)  # attention and seeded samples: torch
    except UserError as error:
        print(f"error: {error.naming(FLAGS)}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
