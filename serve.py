"""Serve a trained run over HTTP: a JSON API and a web page that translates as you type.

  python serve.py --run runs/base                  # http://127.0.0.1:8000/ ; API docs at /docs
  curl -s 127.0.0.1:8000/translate -H 'content-type: application/json' \\
       -d '{"texts": ["I am cold."], "n_best": 2, "alignment": true}'

Needs the serve extra: pip install -e ".[serve]". The model loads before the server listens: a run
that cannot be loaded stops here with one error line.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from transformer.errors import UserError
from transformer.training.logs import setup_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--run", type=Path, help="run directory (default: the newest run under runs/)")
    where.add_argument("--checkpoint", type=Path, help="a checkpoint directory, e.g. runs/base/checkpoints/best")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    parser.add_argument("--threads", type=int, default=0, metavar="N", help="CPU threads (default: one per core)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(level=logging.INFO)
    try:
        try:
            import uvicorn

            from transformer.serving.app import create_app
        except ImportError as error:
            raise UserError(f"serving needs FastAPI and uvicorn ({error.name} is missing): "
                            "pip install -e \".[serve]\"") from None
        from transformer.runtime import select_device, set_threads
        from transformer.translation.torch_engine import load_translator

        if args.threads < 0:
            raise UserError(f"--threads must be 0 (the default) or more, got {args.threads}")
        set_threads(args.threads)
        translator = load_translator(args.run, args.checkpoint, select_device(args.device, key="--device"))
        app = create_app(translator, attention=translator)  # the torch engine also gives the attention
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
