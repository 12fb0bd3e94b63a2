"""Run the registered benchmarks and write their report: ``results.md`` (markdown), ``engine.png`` (the bar chart)
and the sections' line charts in a folder. (How each benchmark times its variants: :mod:`~pagedcore.benchmarks.runner`.)

The output folder, device and dtype are checked before anything runs, so a bad ``--out`` or a missing GPU fails in
a second with a :class:`~pagedcore.errors.ConfigError` instead of a traceback minutes into a run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedcore.errors import ConfigError, PagedCoreError

from .chart import Panel, write_chart
from .context import BenchContext
from .options import BenchOptions, add_arguments, options_from
from .plots import write_lines
from .registry import BENCHMARKS
from .report import Section, machine_info

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["prepare_out_dir", "run_all", "run_benchmarks", "run_one", "script_main"]

CHART = "engine.png"


def prepare_out_dir(path: str | os.PathLike[str]) -> Path:
    """Create the output folder ``path`` if needed and check that files can be written in it.

    Raises:
        ConfigError: ``path`` is a file, cannot be created, or is not writable.

    Example:
        >>> out = prepare_out_dir(Path(tempfile.mkdtemp()) / "bench-out")
        >>> out.is_dir()
        True
        >>> (out / "notes.txt").write_text("a file")
        6
        >>> prepare_out_dir(out / "notes.txt")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: output folder '.../notes.txt' is a file, not a folder
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output folder {str(out)!r} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write to output folder {str(out)!r}: {exc.strerror or exc}") from None
    return out


@contextlib.contextmanager
def _threads(options: BenchOptions) -> Iterator[None]:
    if options.threads is None or not options.needs_torch:  # the core benchmark runs no torch
        yield
        return
    from .runner import torch_threads

    with torch_threads(options.threads):
        yield


@contextlib.contextmanager
def _engine_compile(options: BenchOptions) -> Iterator[None]:
    """The run's Engines decode as ``--engine-compile`` says (:data:`~.peers.ENGINE_COMPILE`, for this run only)."""
    if not options.needs_torch:
        yield
        return
    from .options import ENGINE_COMPILE as MODES
    from .peers import ENGINE_COMPILE

    token = ENGINE_COMPILE.set(MODES[options.engine_compile])
    try:
        yield
    finally:
        ENGINE_COMPILE.reset(token)


def _settings_line(ctx: BenchContext) -> str:
    options = ctx.options
    if not options.needs_torch:
        return "- Device, dtype, model: none (the core benchmark is plain Python)"
    from pagedcore.cli.devices import describe_device

    shape = options.model_shape
    model = (
        f"{options.model_size_name} (Llama, random weights: hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers, {shape['num_attention_heads']} heads / {shape['num_key_value_heads']} "
        f"KV heads, vocab {shape['vocab_size']})"
    )
    decode = {
        "auto": "the Engine's default (eager)",
        "eager": "eager",
        "inductor": "compiled by inductor",
        "cudagraphs": "CUDA graphs (hybrid models: eager)",
    }[options.engine_compile]
    return (
        f"- Device: {describe_device(ctx.device)}; dtype: {options.dtype}; model size: {model}; the Engines' decode "
        f"steps: {decode} (`--engine-compile {options.engine_compile}`)"
    )


def _chart(sections: dict[str, Section]) -> tuple[list[Panel], str]:
    """The panels of the sections that offer some, in ``chart_rank`` order, and the first one's title."""
    ranked = sorted((BENCHMARKS[name].chart_rank, name) for name in sections if BENCHMARKS[name].chart_rank is not None)
    shown = [sections[name] for _, name in ranked if sections[name].panels]
    return [panel for section in shown for panel in section.panels], shown[0].chart_title if shown else ""


def run_benchmarks(
    options: BenchOptions,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    model: PreTrainedModel | None = None,
    on_start: Callable[[], None] | None = None,
) -> str:
    """Run the benchmarks ``options`` name on one shared model; returns the markdown report.

    With ``out_dir``, also write ``out_dir/results.md``, ``engine.png`` when a section offers chart panels, and the
    sections' line charts (:class:`~pagedcore.benchmarks.plots.LineChart`, e.g. ``decode.png``).
    ``model``: benchmark this model instead of building one from the options. ``on_start``: called once the options,
    device and output folder are checked, before the first benchmark (the command line's start-up line).

    Example:
        >>> out = Path(tempfile.mkdtemp())
        >>> markdown = run_benchmarks(BenchOptions(quick=True, only=("core",), progress=False), out)  # doctest: +SKIP
        >>> markdown.splitlines()[0], sorted(p.name for p in out.iterdir())  # doctest: +SKIP
        ('# pagedcore benchmarks (quick workload)', ['results.md'])
    """
    ctx = BenchContext(options, model)
    ctx.check()
    out = prepare_out_dir(out_dir) if out_dir is not None else None
    if on_start is not None:
        on_start()
    started = time.perf_counter()
    with _threads(options), _engine_compile(options):
        machine = machine_info()  # before the sections: its load average is the one at the start
        sections = {name: BENCHMARKS[name].run(ctx).section() for name in options.names}
    elapsed = time.perf_counter() - started
    title = "# pagedcore benchmarks" + (" (quick workload)" if options.quick else "")
    intro = (
        f"Run on {machine}; {elapsed:.0f} s in all. Wall-clock figures depend on what else the machine is "
        "doing: compare figures measured on a quiet machine."
    )
    settings = f"{_settings_line(ctx)}\n- Benchmarks: {', '.join(options.names)}"
    panels, chart_title = _chart(sections)
    parts = [title, intro, settings, *(section.markdown() for section in sections.values())]
    if panels:
        parts.append(f"![]({CHART})\n")
    markdown = "\n\n".join(parts)
    if out is not None:
        (out / "results.md").write_text(markdown)
        charts = [chart for section in sections.values() for chart in section.line_charts]
        if (panels or charts) and importlib.util.find_spec("matplotlib") is None:
            print("pagedcore bench: no charts written: they need matplotlib (the bench extra)", file=sys.stderr)
            return markdown
        if panels:
            write_chart(out / CHART, panels, chart_title)
        for chart in charts:
            write_lines(out / chart.file, chart.panels, chart.title)
    return markdown


def run_all(
    quick: bool = False,
    out_dir: str | os.PathLike[str] = "bench-out",
    progress: bool = True,
    threads: int | None = None,
    **settings: Any,
) -> str:
    """Run every benchmark (or ``only=(...)``) on one model; write ``out_dir/results.md`` and ``out_dir/engine.png``.

    ``threads``: torch intra-op threads for the run (default: torch's, one per core); ``settings``: the other fields
    of :class:`BenchOptions` (``device``, ``dtype``, ``model_size``, ``only``, ``seed``). Returns the markdown.

    Example:
        >>> BenchOptions(quick=True).model_shape["num_hidden_layers"]   # the model a quick run builds and shares
        4
        >>> markdown = run_all(quick=True, out_dir="bench-out", progress=False, threads=1)  # doctest: +SKIP
        >>> markdown.splitlines()[0]  # doctest: +SKIP
        '# pagedcore benchmarks (quick workload)'
        >>> sorted(p.name for p in Path("bench-out").iterdir())  # doctest: +SKIP
        ['engine.png', 'results.md']
    """
    options = BenchOptions(quick=quick, progress=progress, threads=threads, **settings)
    return run_benchmarks(options, out_dir)


def run_one(name: str, quick: bool = False, progress: bool = True, threads: int | None = None, **settings: Any) -> str:
    """Run one benchmark of :data:`~pagedcore.benchmarks.registry.BENCHMARKS`; returns its markdown section.

    Example:
        >>> run_one("nonesuch")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: unknown benchmark 'nonesuch'; choose from prefix, cold, memory, engine, core, ...
        >>> print(run_one("memory", quick=True, progress=False, threads=1))  # doctest: +SKIP
        ### 3. KV memory of a mixed-length batch (quick workload)
        ...
    """
    return _section(BenchOptions(quick=quick, progress=progress, threads=threads, only=(name,), **settings))


def _section(options: BenchOptions) -> str:
    """The markdown section of the one benchmark ``options`` name (no title, no files)."""
    (name,) = options.names
    ctx = BenchContext(options)
    ctx.check()
    with _threads(options):
        return BENCHMARKS[name].run(ctx).markdown()


def script_main(name: str, argv: list[str] | None = None, description: str = "") -> int:
    """The command line of the ``examples/bench_*.py`` scripts: run benchmark ``name`` and print its markdown.

    Options: those of ``pagedcore bench`` but ``--only`` (``--quick``, ``--device``, ``--dtype``, ``--model-size``,
    ``--threads``, ``--no-progress``) and ``--out FILE`` (also write the report). Bad options exit 2 with one line.

    Example:
        >>> script_main("memory", ["--quick", "--no-progress", "--threads", "1"])  # doctest: +SKIP
        ### 3. KV memory of a mixed-length batch (quick workload)
        ...
        0
    """
    parser = argparse.ArgumentParser(description=description.splitlines()[0] if description else None)
    add_arguments(parser, several=False)
    parser.add_argument("--out", type=Path, help="also write the markdown report to this file")
    args = parser.parse_args(argv)
    try:
        options = options_from(args, only=(name,))
        if args.threads is None and options.needs_torch:
            from pagedcore.cli.threads import choose_threads

            choice = choose_threads()  # stated on stderr once the run is under way
            options = dataclasses.replace(options, threads=choice.threads)
            BenchContext(options).check()
            print(f"{parser.prog}: {choice.describe()}", file=sys.stderr)
        if args.out is not None:
            prepare_out_dir(args.out.parent)
            if args.out.is_dir():
                raise ConfigError(f"--out {str(args.out)!r} is a folder; give a file name")
        markdown = _section(options)
    except PagedCoreError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(markdown)
    if args.out is not None:
        args.out.write_text(markdown)
    return 0
