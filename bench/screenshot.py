"""The README's picture of the web page: serve.py on a trained run, a sentence typed into the page in
Debian's chromium (through Playwright), and a screenshot once the translation, its attention and the
search step by step are drawn.

    python bench/screenshot.py --run runs/base --out docs/serve_beam.png --colors 256
    python bench/screenshot.py --run runs/base --text "Where is the station?" --out /tmp/page.png

Needs the serve extra and chromium (Debian: apt-get install chromium). The server runs as a user
starts it (python serve.py --run RUN --port P) and is stopped afterwards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, server: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        if server.poll() is not None:
            sys.exit(f"error: serve.py stopped: {server.stderr.read().decode().strip()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if json.load(response)["status"] == "ok":
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"error: serve.py did not answer {url} within {seconds:.0f} s")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--text", default="The cat is sleeping on the sofa.", help="what is typed into the page")
    parser.add_argument("--width", type=int, default=1200, help="the window's width: at 1200 the search is "
                                                                 "beside the attention, narrower below it")
    parser.add_argument("--height", type=int, default=700)
    parser.add_argument("--colors", type=int, default=0, help="store the PNG with a palette of this many colours "
                                                                "(needs Pillow): a third of the size (default: 0, all)")
    args = parser.parse_args()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sys.exit("error: playwright is not installed: pip install playwright")
    if args.colors:
        if not 2 <= args.colors <= 256:
            sys.exit(f"error: --colors must be from 2 to 256 (0: all), got {args.colors}")
        try:
            from PIL import Image
        except ImportError:
            sys.exit("error: --colors needs Pillow: pip install pillow")
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("error: no chromium on PATH (Debian: apt-get install chromium)")
    port = free_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--run", str(args.run), "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(f"http://127.0.0.1:{port}/health", server, 300)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True)
            try:
                page = browser.new_page(viewport={"width": args.width, "height": args.height})
                page.goto(f"http://127.0.0.1:{port}/")
                page.locator("#source").press_sequentially(args.text, delay=30)  # typed: the page's debounce runs
                page.wait_for_selector("#heatmap td", timeout=30_000)
                page.wait_for_selector("#verdict:not(:empty)", timeout=60_000)  # asked once the translation is in
                page.wait_for_timeout(500)  # the last keystroke's answers drawn
                args.out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.out), full_page=True)
                if args.colors:
                    with Image.open(args.out) as shot:
                        paletted = shot.convert("RGB").quantize(args.colors, method=Image.Quantize.MEDIANCUT)
                    paletted.save(args.out, optimize=True)
                print(f"{args.out}: {args.text!r} -> {page.locator('#translation').inner_text()!r}")
                print(page.locator("#verdict").inner_text())
            finally:
                browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
