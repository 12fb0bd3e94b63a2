"""How a model benchmark is timed, in one place: the clock, the streamers that stamp tokens, torch's thread count,
and the :class:`Runner` every benchmark times its variants with (progress bar, the machine it ran on, untimed
warm-ups, rounds whose order rotates, medians, and a variant that cannot run keeping its row with the reason).

- :func:`clock`: ``time.perf_counter`` once the device's queued work is done, so a GPU timing ends when the work
  does. :func:`timed` times one call with it.
- :class:`FirstTokenClock` / :class:`TokenStamps`: streamers that stamp the first / every generated token.
- :class:`Runner`: ``warm_up(names, fn)`` runs each variant once untimed; ``rounds(names, repeats, fn)`` runs every
  variant once per round, the order rotating each round (:func:`rotated`) to spread drift over the variants, and
  returns :class:`Trials` (each variant's times and outputs, medians); ``attempt(fn)`` runs a variant that may fail.
- :func:`torch_threads`, :func:`progress_bar`, :func:`percentile`.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from transformers.generation.streamers import BaseStreamer

from .common import describe_model
from .context import BenchContext
from .report import Header, machine_info

__all__ = ["FirstTokenClock", "Runner", "Timed", "TokenStamps", "Trials", "clock", "rotated", "torch_threads"]

T = TypeVar("T")


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` is done (CUDA runs asynchronously).

    Example:
        >>> clock(torch.device("cpu")) <= time.perf_counter()
        True
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass(frozen=True)
class Timed:
    """One timed call: its seconds (wall, or per token), what it computed, and its time to the first token.

    Example:
        >>> Timed(0.5, [7, 8], first_token=0.1).seconds
        0.5
    """

    seconds: float
    output: Any = None
    first_token: float | None = None


def timed(device: torch.device, fn: Callable[[], Any]) -> Timed:
    """Wall time of ``fn()`` on ``device`` (:func:`clock` before and after), with its result as the output."""
    start = clock(device)
    output = fn()
    return Timed(clock(device) - start, output)


class FirstTokenClock(BaseStreamer):
    """A streamer that timestamps the first generated token (``generate`` first puts the prompt, then each token).

    ``generate`` hands the streamer tokens copied to the CPU, so the stamp waits for the device to compute them.

    Example:
        >>> stamp = FirstTokenClock()
        >>> for value in ("prompt", 1, 2):
        ...     stamp.put(value)
        >>> stamp.first_token_time is not None
        True
    """

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_time: float | None = None

    def put(self, value: Any) -> None:
        """Called by ``generate`` with the prompt, then with every new token."""
        self.puts += 1
        if self.puts == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        """Called by ``generate`` at the end."""


class TokenStamps(BaseStreamer):
    """A streamer that stamps every generated token (``generate`` puts the prompt first, then each new token, copied
    to the CPU: a stamp waits for the device to compute its token).

    Example:
        >>> stamps = TokenStamps()
        >>> for value in ("prompt", 1, 2, 3):
        ...     stamps.put(value)
        >>> len(stamps.stamps), stamps.per_decode_step() >= 0
        (3, True)
    """

    def __init__(self) -> None:
        self.puts = 0
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        """Called by ``generate`` with the prompt, then with every new token."""
        self.puts += 1
        if self.puts > 1:
            self.stamps.append(time.perf_counter())

    def end(self) -> None:
        """Called by ``generate`` at the end."""

    def per_decode_step(self) -> float:
        """Seconds from the first generated token to the last, per decode step between them."""
        if len(self.stamps) < 2:
            raise ValueError("a decode time needs at least two generated tokens")
        return (self.stamps[-1] - self.stamps[0]) / (len(self.stamps) - 1)


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """``items`` rotated left by ``shift``: round ``shift``'s order (with two items: alternating).

    Example:
        >>> rotated(["a", "b", "c"], 1), rotated(["a", "b"], 3)
        (['b', 'c', 'a'], ['b', 'a'])
    """
    k = shift % len(items) if items else 0
    return [*items[k:], *items[:k]]


def failure(exc: BaseException, width: int = 200) -> str:
    """The cell of a variant that could not run: ``n/a (Type: first line of the message)``.

    Example:
        >>> failure(RuntimeError("no GPU kernel for this\\nmore")), failure(KeyError())
        ('n/a (RuntimeError: no GPU kernel for this)', 'n/a (KeyError: )')
    """
    first = (str(exc).splitlines() or [""])[0]
    return f"n/a ({type(exc).__name__}: {first[:width]})"


@dataclass
class Trials:
    """Every variant's timed calls, round by round (see :meth:`Runner.rounds`).

    Example:
        >>> trials = Trials({"a": [Timed(1.0, [1]), Timed(3.0, [1])], "b": [Timed(2.0, [2])]})
        >>> trials.median("a"), trials.seconds("a"), trials.outputs("b")
        (2.0, [1.0, 3.0], [[2]])
    """

    runs: dict[str, list[Timed]] = field(default_factory=dict)

    def seconds(self, name: str) -> list[float]:
        """A variant's seconds, per round."""
        return [run.seconds for run in self.runs[name]]

    def outputs(self, name: str) -> list[Any]:
        """What a variant computed, per round."""
        return [run.output for run in self.runs[name]]

    def median(self, name: str) -> float:
        """A variant's median seconds."""
        return statistics.median(self.seconds(name))


class Runner:
    """Times one benchmark's variants on a run's context: a progress bar of ``total`` steps (when the run shows
    progress), the machine (read when the runner starts), untimed warm-ups and rotating rounds.

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> ctx = BenchContext(BenchOptions(quick=True, progress=False))
        >>> with Runner(ctx, "demo", total=6) as runner:
        ...     runner.warm_up(["a", "b"], lambda name: None)
        ...     trials = runner.rounds(["a", "b"], 2, lambda name, r: Timed(float(r), name))
        >>> trials.seconds("b"), [name for name in trials.outputs("a")], "cores" in runner.machine
        ([0.0, 1.0], ['a', 'a'], True)
        >>> runner.attempt(lambda: 1 / 0)
        (None, 'n/a (ZeroDivisionError: division by zero)')
        >>> runner.header("Llama").quick, runner.header("Llama").model
        (True, 'Llama')
    """

    def __init__(self, ctx: BenchContext, desc: str, total: int) -> None:
        self.ctx = ctx
        self.machine = machine_info()
        self._bar = progress_bar(total, desc, ctx.progress)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the progress bar."""
        self._bar.close()

    def header(self, model: str | None = None) -> Header:
        """The section's header: the run's quick setting, ``model`` (default: the run's model described), the
        machine."""
        return Header(self.ctx.quick, model if model is not None else describe_model(self.ctx.model()), self.machine)

    def label(self, text: str) -> None:
        """Show what runs now next to the bar."""
        self._bar.set_postfix_str(text)

    def tick(self, steps: int = 1) -> None:
        """Advance the bar."""
        self._bar.update(steps)

    def warm_up(self, names: Sequence[str], fn: Callable[[str], object]) -> None:
        """Run ``fn(name)`` once per variant, untimed."""
        for name in names:
            fn(name)
            self.tick()

    def rounds(self, names: Sequence[str], repeats: int, fn: Callable[[str, int], Timed]) -> Trials:
        """``repeats`` rounds of ``fn(name, round)`` for every variant, round ``r`` in :func:`rotated` order."""
        trials = Trials({name: [] for name in names})
        for r in range(repeats):
            for name in rotated(names, r):
                trials.runs[name].append(fn(name, r))
                self.tick()
        return trials

    def attempt(self, fn: Callable[[], T], width: int = 200) -> tuple[T | None, str | None]:
        """``(fn(), None)``, or ``(None, why)`` when it raises: a variant that cannot run keeps its row with the
        reason (:func:`failure`)."""
        try:
            return fn(), None
        except Exception as exc:
            return None, failure(exc, width)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)`` (no change for None); restored afterwards.

    On a machine where other jobs compete for the cores, one thread gives steadier (if slower) figures than as many
    threads as cores, whose synchronisation suffers whenever one of them is descheduled.

    Example:
        >>> before = torch.get_num_threads()
        >>> with torch_threads(1):
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == before
        True
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar that vanishes when done (or a disabled one)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=not enabled, dynamic_ncols=True)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100); NaN for no values.

    Example:
        >>> percentile([1.0, 2.0, 3.0, 4.0], 50), math.isnan(percentile([], 99))
        (2.5, True)
    """
    data = sorted(values)
    if not data:
        return math.nan
    k = (len(data) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)
