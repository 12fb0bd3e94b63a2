"""The incremental detokenizer's cost per token, through a fast tokenizer's Rust backend (what
:func:`~pagedcore.engine.detokenizer.decoder_of` picks for a plain transformers fast tokenizer) and through
transformers' ``decode`` wrapper (what it used before, and still uses for tokenizers that change their decoding).

A server pays it once per token per running sequence, inside the Engine's record stage. Each round feeds
``--tokens`` ids (a cycle over ``--ids``) to a fresh :class:`~pagedcore.engine.detokenizer.IncrementalDetokenizer`
per way, the ways alternating; medians of ``--rounds`` rounds. The joined texts of both ways are checked equal to
``tokenizer.decode`` of the ids.

    python scripts/detokenizer_bench.py [--tokens 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from pagedcore.adapters.transformers.builtin import builtin_tokenizer
from pagedcore.engine import detokenizer
from pagedcore.engine.detokenizer import IncrementalDetokenizer


def _tokenizers() -> dict[str, tuple[Any, range]]:
    """The built-in character tokenizer, and the tests' byte-level BPE (GPT-2 / Llama 3 / Qwen's alphabet)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from byte_text import byte_tokenizer  # the tests' helper, found by path

    return {
        "built-in (characters)": (builtin_tokenizer(), range(5, 99)),
        "byte-level BPE": (byte_tokenizer(), range(32, 240)),
    }


def _run(tokenizer: Any, ids: list[int], backend: bool) -> tuple[float, str]:
    """Seconds per token and the text released, one way."""
    chosen = detokenizer.decoder_of if backend else (lambda t: partial(t.decode, skip_special_tokens=True))
    original = detokenizer.decoder_of
    detokenizer.decoder_of = chosen  # type: ignore[assignment]
    try:
        detok = IncrementalDetokenizer(tokenizer)
    finally:
        detokenizer.decoder_of = original  # type: ignore[assignment]
    started = time.perf_counter()
    pieces = [detok.step(token) for token in ids]
    seconds = (time.perf_counter() - started) / len(ids)
    return seconds, "".join(pieces) + detok.flush()


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    lines = ["| tokenizer | through transformers' decode | through the backend | ratio |", "|---|---|---|---|"]
    for name, (tokenizer, alphabet) in _tokenizers().items():
        ids = list(itertools.islice(itertools.cycle(alphabet), args.tokens))
        want = tokenizer.decode(ids, skip_special_tokens=True)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for backend in (False, True):
                seconds, text = _run(tokenizer, ids, backend)
                if text != want:
                    raise SystemExit(f"{name}: the {'backend' if backend else 'wrapper'} way released other text")
                times[backend].append(seconds)
        wrapper, fast = statistics.median(times[False]), statistics.median(times[True])
        lines.append(f"| {name} | {1e6 * wrapper:.2f} us | {1e6 * fast:.2f} us | {wrapper / fast:.2f}x |")
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
