"""README.md and docs/*.md as a reader meets them: every code block runs, every output shown is what it prints, every
relative link leads somewhere, and every measured figure names the benchmark that made it.

The rules a page follows (docs/development.md, "Documentation pages"):

- A ```python block runs, in order, in one namespace per page (so a page builds its model once). A ```bash block's
  commands run: ``pagedcore ...`` through ``pagedcore.cli.main`` in this process, ``python ...`` with this
  interpreter from the repository root.
- A ```text block right after a code block is that block's output, compared as doctest compares (``...`` matches
  anything, whitespace is normalized).
- A block that cannot run here says so on the line before it, in an HTML comment that names the test covering it:
  ``<!-- docs-test: skip: WHY; tested by tests/<file>.py::<test> -->``. ``<!-- docs-test: server -->`` blocks run
  against a ``pagedcore serve`` this test starts (``127.0.0.1:8000`` is replaced by its address);
  ``<!-- docs-test: file PATH -->`` blocks must be an excerpt of that file.
- A paragraph, list item or table with a measured figure (``1.2 s``, ``40 ms``, ``3.1x``, ``255 tokens/s``, ...)
  names what measured it: ``pagedcore bench``, a script under ``examples/`` or ``scripts/``, a test, or a section of
  docs/benchmarks.md. docs/benchmarks.md and docs/structured.md are the benchmarks' own reports.

docs/families.md is generated from the family tests and is not checked here.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import itertools
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "families.md")]
REPORTS = {"benchmarks.md", "structured.md"}  # the benchmarks' own output: every figure there is theirs
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|server|file)\b:?\s*(.*?)\s*-->")
CODE = {"python", "bash"}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    marker: tuple[str, str] | None = None
    output: str | None = None
    end: int = 0  # the index of its closing fence in the page's lines

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse(page: Path) -> list[Block]:
    """The page's code blocks, each with the marker on the line before it and the ```text block that follows it."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        start, lang = i, fence.group(2)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        text = "\n".join(line[len(fence.group(1)) :] for line in lines[start + 1 : end])
        previous = lines[start - 1].strip() if start else ""
        marker = MARKER.fullmatch(previous)
        block = Block(page, start + 1, lang, text, (marker.group(1), marker.group(2)) if marker else None, end=end)
        follows = blocks and blocks[-1].lang in CODE and blocks[-1].output is None
        if lang == "text" and follows and all(not line.strip() for line in lines[blocks[-1].end + 1 : start]):
            blocks[-1].output = text
            i = end + 1
            continue
        blocks.append(block)
        i = end + 1
    return blocks


def code_blocks(page: Path) -> list[Block]:
    """The blocks the test runs or checks: code, and excerpts of files (any language)."""
    return [b for b in parse(page) if b.lang in CODE or (b.marker and b.marker[0] == "file")]


def commands(text: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def check_output(block: Block, got: str) -> None:
    if block.output is None:
        return
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    want = block.output.strip() + "\n"
    assert checker.check_output(want, got.strip() + "\n", flags), (
        f"{block.where}: the output shown is not what the block prints:\n--- shown\n{want}--- printed\n{got}"
    )


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_command(block: Block, command: str, replacements: dict[str, str] | None = None) -> str:
    for old, new in (replacements or {}).items():
        command = command.replace(old, new)
    argv = shlex.split(command)
    if argv[0] == "curl" and shutil.which("curl") is None:
        return curl_without_curl(argv)
    if argv[0] == "pagedcore":  # in this process: the command line itself, without paying its imports again
        return run_cli(block, argv[1:])
    if argv[0] in ("python", "python3"):
        argv = [sys.executable, *argv[1:]]
    done = subprocess.run(argv, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{block.where}: {command!r} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


def run_cli(block: Block, argv: list[str]) -> str:
    import torch

    from pagedcore.cli import main

    threads = torch.get_num_threads()
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(io.StringIO()) as err:
            code = main(argv)
    finally:
        torch.set_num_threads(threads)  # a command without --threads chose its own
    assert code == 0, f"{block.where}: pagedcore {' '.join(argv)} exited {code}: {err.getvalue()[-2000:]}"
    return buffer.getvalue()


def curl_without_curl(argv: list[str]) -> str:
    """``curl -s URL -H HEADER -d DATA`` through httpx, where curl is not installed."""
    import httpx

    url = next(a for a in argv[1:] if a.startswith("http"))
    headers = dict(h.split(": ", 1) for flag, h in itertools.pairwise(argv) if flag == "-H")
    data = next((d for flag, d in itertools.pairwise(argv) if flag == "-d"), None)
    response = httpx.request("POST" if data else "GET", url, headers=headers, content=data, timeout=120)
    return response.text


def run_python(block: Block, namespace: dict) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            exec(compile(block.text, block.where, "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"{block.where}: the block raised {type(exc).__name__}: {exc}") from exc
    return buffer.getvalue()


def covering_test(block: Block) -> None:
    """A skipped block names the test that covers it, and that test exists."""
    found = re.search(r"tested by (tests/[\w/]+\.py)::(\w+)", block.marker[1] if block.marker else "")
    assert found, f"{block.where}: a block that does not run here must say 'tested by tests/FILE.py::TEST'"
    path, name = ROOT / found.group(1), found.group(2)
    assert path.is_file() and re.search(rf"^\s*(async )?def {name}\(", path.read_text(), re.M), (
        f"{block.where}: {found.group(0)} does not exist"
    )


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
@pytest.mark.usefixtures("one_thread")
def test_every_code_block_runs_and_prints_what_the_page_shows(page):
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for block in code_blocks(page):
        kind = block.marker[0] if block.marker else None
        if kind == "skip":
            covering_test(block)
        elif kind == "file":
            source = (ROOT / block.marker[1].split()[0]).read_text()
            missing = [line for line in block.text.splitlines() if line.strip() and line.strip() not in source]
            assert not missing, f"{block.where}: not in {block.marker[1]}: {missing}"
        elif kind == "server":
            continue  # test_the_server_examples_answer
        elif block.lang == "python":
            check_output(block, run_python(block, namespace))
        else:
            check_output(block, "".join(run_command(block, command) for command in commands(block.text)))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_server_examples_answer():
    """The blocks marked ``server``, against one ``pagedcore serve`` of the built-in model."""
    blocks = [b for page in PAGES for b in code_blocks(page) if b.marker and b.marker[0] == "server"]
    assert blocks, "the README shows the server with curl and the openai client"
    port = free_port()
    command = [sys.executable, "-m", "pagedcore", "serve", "--port", str(port), "--threads", "1"]
    server = subprocess.Popen(command, env=environment(), stderr=subprocess.DEVNULL)
    address = {"127.0.0.1:8000": f"127.0.0.1:{port}"}
    try:
        import httpx

        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.2)
        namespace: dict = {"__name__": "docs_server"}
        for block in blocks:
            if block.lang == "python":
                text = block.text
                for old, new in address.items():
                    text = text.replace(old, new)
                check_output(block, run_python(Block(block.page, block.line, block.lang, text), namespace))
            else:
                runnable = [c for c in commands(block.text) if not c.startswith("pagedcore")]
                check_output(block, "".join(run_command(block, c, address) for c in runnable))
    finally:
        server.terminate()
        server.wait(timeout=60)


# ---------------------------------------------------------------------- links
def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"`", "", heading.strip().lstrip("#").strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    outside = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(line) for line in outside.splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_leads_to_a_file_and_heading(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        generated = path.endswith("families.md") and file.parent == ROOT / "docs"  # written by the family tests
        missing = not file.exists() and not generated
        if missing or (anchor and file.suffix == ".md" and file.exists() and anchor not in anchors(file)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


# ---------------------------------------------------------------------- figures
FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s?-\s?\d[\d,]*(?:\.\d+)?)?"
    r"(?:\s?(?:ms|µs|us|s|min|KiB|MiB|GiB|MB|GB|tokens/s|requests/s)\b|x\b)"
)
PROVENANCE = re.compile(
    r"pagedcore bench|make bench|examples/[\w/]+\.py|scripts/[\w/]+\.py|tests/test_\w+\.py|benchmarks\.md"
)


def units(page: Path) -> list[tuple[int, str]]:
    """Paragraphs, list items and tables outside code blocks, with their first line numbers."""
    out: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    in_code = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        item = re.match(r"^\s*[-*] |^\s*\d+\. ", line)
        table = line.startswith("|")
        switch = bool(current) and table != current[-1].startswith("|")
        boundary = not line.strip() or item or line.startswith("#") or switch
        if boundary and current:
            out.append((start, "\n".join(current)))
            current = []
        if line.strip() and not line.startswith("#"):
            if not current:
                start = number
            current.append(line)
    if current:
        out.append((start, "\n".join(current)))
    return out


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in REPORTS], ids=lambda p: p.name)
def test_every_figure_names_the_benchmark_that_made_it(page):
    unnamed = []
    found = units(page)
    for index, (line, text) in enumerate(found):
        figures = FIGURE.findall(re.sub(r"`[^`]*`", "", text))
        if not figures or PROVENANCE.search(text):
            continue
        caption = found[index - 1][1] if index and text.startswith("|") else ""
        if PROVENANCE.search(caption):
            continue
        unnamed.append(f"line {line}: {figures[:3]}")
    assert not unnamed, f"{page.relative_to(ROOT)}: figures without their benchmark: {unnamed}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_script_and_test_a_page_names_exists(page):
    named = set(re.findall(r"(?:examples|scripts|tests)/[\w/]+\.(?:py|sh)", page.read_text()))
    assert not [path for path in named if not (ROOT / path).is_file()], page.relative_to(ROOT)
