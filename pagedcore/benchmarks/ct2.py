"""CTranslate2 in a process of its own: the model converted with CTranslate2's converter, and a worker that serves
greedy batches with ``ctranslate2.Generator`` over a pipe (one JSON line per request, one per reply).

Why a process of its own: glibc reads its malloc tuning (:data:`TUNED_MALLOC`) from the environment when a process
starts, and CTranslate2's CPU speed depends on it (with the default settings its large buffers are mmap'd and
unmapped on every step, page-faulting each time); the benchmark's own process, where the Engine runs, keeps its
environment. Nothing here imports ctranslate2 or torch at import time; the worker (``python -m
pagedcore.benchmarks.ct2 serve ...``) imports ctranslate2 only, and the conversion runs CTranslate2's own command
(``python -m ctranslate2.converters.transformers``, the module behind ``ct2-transformers-converter``).

- :func:`missing`: why CTranslate2 cannot run here (None when it can).
- :func:`convert_model`: save a transformers model (and a word-level tokenizer whose token ``i`` is id ``i``) and
  convert it; :func:`worker_env`: the environment of a worker with or without the malloc tuning.
- :class:`Worker`: the client side of one worker process; :class:`Reply`: what one request computed and when.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pagedcore.extras import install_hint

__all__ = ["TUNED_MALLOC", "Reply", "Worker", "convert_model", "missing", "worker_env"]

# glibc's malloc as a CPU user of CTranslate2 tunes it (issue 23): keep freed memory instead of unmapping it each step.
TUNED_MALLOC: dict[str, str] = {
    "MALLOC_MMAP_THRESHOLD_": "4000000000",
    "MALLOC_TRIM_THRESHOLD_": "4000000000",
    "MALLOC_TOP_PAD_": "1000000000",
}
MODULE = "pagedcore.benchmarks.ct2"
CONVERTER = "ctranslate2.converters.transformers"  # the module of the `ct2-transformers-converter` command


def missing() -> str | None:
    """Why CTranslate2 cannot run here, or None when the ``ctranslate2`` package is installed.

    Example:
        >>> missing() in (None, f"ctranslate2 is not installed ({install_hint('bench')})")
        True
    """
    if importlib.util.find_spec("ctranslate2") is None:
        return f"ctranslate2 is not installed ({install_hint('bench')})"
    return None


def _package_root() -> str:
    """The folder that holds the ``pagedcore`` package (a worker imports the same pagedcore as this process)."""
    return str(Path(__file__).resolve().parents[2])


def worker_env(malloc: Mapping[str, str] | None) -> dict[str, str]:
    """This process's environment for a child, with ``malloc`` set (None: every ``MALLOC_*_`` setting removed, so
    glibc's defaults apply) and this pagedcore first on ``PYTHONPATH``.

    Example:
        >>> env = worker_env(TUNED_MALLOC)
        >>> env["MALLOC_TOP_PAD_"], "MALLOC_TOP_PAD_" in worker_env(None)
        ('1000000000', False)
    """
    env = {k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") and k.endswith("_"))}
    env.update(malloc or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), os.environ.get("PYTHONPATH", "")) if p)
    return env


def _run(command: list[str], what: str, timeout: float) -> None:
    """Run a child command; a failure raises :class:`RuntimeError` with the last lines of its output."""
    done = subprocess.run(command, capture_output=True, text=True, env=worker_env(None), timeout=timeout, check=False)
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}): {tail}")


def save_tokenizer(vocab_size: int, path: str | os.PathLike[str],
                   special: Sequence[str] = ("<pad>", "<s>", "</s>")) -> None:  # fmt: skip
    """Save a word-level tokenizer whose token ``i`` is id ``i`` (``special`` first, then ``t3``, ``t4``, ...): the
    converter reads the vocabulary from the model's tokenizer, and the benchmark's prompts are token ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {name: i for i, name in enumerate(special)} | {f"t{i}": i for i in range(len(special), vocab_size)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=special[0])),
        pad_token=special[0], bos_token=special[1], eos_token=special[2],
    )  # fmt: skip
    tokenizer.save_pretrained(path)


def convert_model(model: Any, root: str | os.PathLike[str], timeout: float = 1800.0) -> Path:
    """``model`` saved with ``save_pretrained`` under ``root/hf`` (with :func:`save_tokenizer`), converted by
    CTranslate2's converter (weights kept as stored: float32 for a float32 model) into ``root/ct2``, returned.

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> out = convert_model(bench_model(size="tiny"), tempfile.mkdtemp())  # doctest: +SKIP
        >>> sorted(p.name for p in out.iterdir())  # doctest: +SKIP
        ['config.json', 'model.bin', 'vocabulary.json']
    """
    hf, out = Path(root) / "hf", Path(root) / "ct2"
    model.save_pretrained(hf)
    save_tokenizer(model.config.vocab_size, hf)
    _run([sys.executable, "-m", CONVERTER, "--model", str(hf), "--output_dir", str(out), "--force"],
         "ct2-transformers-converter", timeout)  # fmt: skip
    return out


@dataclass(frozen=True)
class Reply:
    """What a worker computed for one request, its times in seconds since the worker received it.

    Attributes:
        tokens: per request, its greedy tokens.
        seconds: the ``generate_batch`` call, as the worker timed it.
        first: per request, when its first token was generated.
        last: per request, when its last token was generated.

    Example:
        >>> Reply([[4, 5]], seconds=0.5, first=[0.25], last=[0.5]).tokens
        [[4, 5]]
    """

    tokens: list[list[int]]
    seconds: float
    first: list[float]
    last: list[float]


class Worker:
    """One CTranslate2 worker process: a ``ctranslate2.Generator`` on ``model_dir`` in ``compute_type`` with
    ``threads`` threads, started with ``malloc`` in its environment (None: glibc's defaults). The constructor waits
    until the model is loaded; ``version`` and ``malloc`` are what the worker reported then: its CTranslate2 version
    and the ``MALLOC_*_`` settings its own environment holds.

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> model_dir = convert_model(bench_model(size="tiny"), tempfile.mkdtemp())  # doctest: +SKIP
        >>> with Worker(model_dir, "float32", threads=1, malloc=TUNED_MALLOC) as worker:  # doctest: +SKIP
        ...     reply = worker.generate([[5, 6, 7], [8, 9, 10]], [3, 2])
        >>> [len(t) for t in reply.tokens]  # doctest: +SKIP
        [3, 2]
    """

    def __init__(self, model_dir: str | os.PathLike[str], compute_type: str, threads: int,
                 malloc: Mapping[str, str] | None) -> None:  # fmt: skip
        self._stderr: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close())
        command = [sys.executable, "-m", MODULE, "serve", "--model", str(model_dir), "--compute-type", compute_type,
                   "--threads", str(threads)]  # fmt: skip
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                         text=True, env=worker_env(malloc))  # fmt: skip
        try:
            ready = self._read()
        except BaseException:
            self.close()
            raise
        self.version = str(ready["ready"])
        self.malloc: dict[str, str] = dict(ready["malloc"])

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            self._process.wait(timeout=30)
            self._stderr.seek(0)
            tail = " | ".join(self._stderr.read().strip().splitlines()[-3:])
            raise RuntimeError(f"the CTranslate2 worker exited ({self._process.returncode}): {tail}")
        message: dict[str, Any] = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"CTranslate2: {message['error']}")
        return message

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: Sequence[int],
                 static_prompt: Sequence[int] = ()) -> Reply:  # fmt: skip
        """Greedy tokens for ``static_prompt + prompt``, ``new_tokens[i]`` of them for prompt ``i`` (eos ignored)."""
        assert self._process.stdin is not None
        request = {"prompts": [list(p) for p in prompts], "new_tokens": list(new_tokens),
                   "static_prompt": list(static_prompt)}  # fmt: skip
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        reply = self._read()
        return Reply(reply["tokens"], reply["seconds"], reply["first"], reply["last"])

    def close(self) -> None:
        """End the worker (closing its input ends its loop) and wait for it."""
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._stderr.close()


# ---------------------------------------------------------------------------------------------------- the worker
def _generate(generator: Any, vocabulary: list[str], request: dict[str, Any]) -> dict[str, Any]:
    """One request on the worker's Generator: greedy, eos ignored (``end_token=[]``), the prompt forwarded at once
    (``include_prompt_in_result=False``), a callback that stamps each token and stops each request at its own count."""
    prompts, news, static = request["prompts"], request["new_tokens"], request["static_prompt"]
    received = time.perf_counter()
    counts, first, last = [0] * len(prompts), [0.0] * len(prompts), [0.0] * len(prompts)

    def step(result: Any) -> bool:
        i, now = result.batch_id, time.perf_counter() - received
        counts[i] += 1
        if counts[i] == 1:
            first[i] = now
        last[i] = now
        return bool(counts[i] >= news[i])

    results = generator.generate_batch(
        [[vocabulary[t] for t in p] for p in prompts], max_length=max(news), end_token=[], sampling_topk=1,
        include_prompt_in_result=False, static_prompt=[vocabulary[t] for t in static] or None, callback=step,
    )  # fmt: skip
    seconds = time.perf_counter() - received
    tokens = [list(r.sequences_ids[0][:n]) for r, n in zip(results, news)]
    return {"tokens": tokens, "seconds": seconds, "first": first, "last": last}


def serve(model_dir: str, compute_type: str, threads: int) -> None:
    """The worker's loop: load the Generator, say ready, then answer one JSON line per request line until stdin
    closes; an error in a request is its reply (``{"error": ...}``)."""
    import ctranslate2

    generator = ctranslate2.Generator(model_dir, device="cpu", compute_type=compute_type, intra_threads=threads,
                                      inter_threads=1)  # fmt: skip
    vocabulary = json.loads((Path(model_dir) / "vocabulary.json").read_text())
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") and k.endswith("_")}
    print(json.dumps({"ready": ctranslate2.__version__, "malloc": malloc}), flush=True)
    for line in sys.stdin:
        try:
            reply = _generate(generator, vocabulary, json.loads(line))
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedcore.benchmarks.ct2 serve --model DIR --compute-type float32 --threads 2``."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="a CTranslate2 worker for the benchmarks")
    commands = parser.add_subparsers(dest="command", required=True)
    worker = commands.add_parser("serve", help="serve greedy batches over stdin/stdout, one JSON line each")
    worker.add_argument("--model", required=True)
    worker.add_argument("--compute-type", default="float32")
    worker.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    serve(args.model, args.compute_type, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
