"""Score a hypothesis file against a test split's reference streams, the way bench/decode.py does.

    python bench/reference/score.py HYP TEST_DIR

TEST_DIR holds test.en and test.fr.1 ... test.fr.K (a blank line in a stream = no reference there),
as written by train.py into RUN/heldout/ and by bench/reference/prepare.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from transformer.translation.metrics import score  # noqa: E402


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    hypotheses = Path(sys.argv[1]).read_text(encoding="utf-8").splitlines()
    test_dir = Path(sys.argv[2])
    n = len((test_dir / "test.en").read_text(encoding="utf-8").splitlines())
    streams = [p.read_text(encoding="utf-8").splitlines()
               for p in sorted(test_dir.glob("test.fr.*"), key=lambda p: int(p.suffix[1:]))]
    if len(hypotheses) != n:
        sys.exit(f"{sys.argv[1]}: {len(hypotheses)} lines, but {test_dir / 'test.en'} has {n}")
    references = [[s[i] for s in streams if s[i].strip()] for i in range(n)]
    scores = score(hypotheses, references)
    print(f"{scores}  ({n} sentences, {len(streams)} reference streams; {scores.signature})")


if __name__ == "__main__":
    main()
