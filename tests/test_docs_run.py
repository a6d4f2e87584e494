"""Every code block of README.md and docs/*.md runs, and shows what the page says it shows.

The runner and its conventions are in tests/docs_runner.py (``python``, ``sh`` and
``console`` blocks run; ``title="FILE"`` writes a file; ``# illustration only: REASON``
as a block's first line, visible on the page, skips it). ``python -m tests.docs_runner``
counts the blocks. docs/cli-reference.md is generated from the commands' own help and
checked by tests/test_docs.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs_runner import (
    INERT,
    ROOT,
    RUNNABLE,
    BlockFailed,
    Page,
    _commands,
    _console,
    output_mismatch,
    parse,
)

PAGES = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "cli-reference.md"),
]

#: pages whose blocks are not yet classified and run (docs-as-tests is being extended to
#: them); every other page must pass test_every_block_is_classified and test_page
PENDING: set[str] = set()

CHECKED = [p for p in PAGES if p.name not in PENDING]


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", CHECKED, ids=_id)
def test_every_block_is_classified(page: Path) -> None:
    """A block is a command (python, sh, console), a file (title=), marked illustration
    only, or plainly not a command (text, toml, yaml, json): never left to guess."""
    loose = [
        b.where
        for b in parse(page)
        if b.lang not in RUNNABLE | INERT and b.title is None and b.illustration is None
    ]
    assert not loose, f"blocks without a known language: {loose}"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a page runs whole jobs; each command has its own limit
@pytest.mark.parametrize("page", CHECKED, ids=_id)
def test_page(page: Path) -> None:
    blocks = parse(page)
    run = [b for b in blocks if b.lang in RUNNABLE and b.illustration is None and not b.title]
    runs = 2 if all(b.lang == "python" for b in run) else 1
    with fixed_ports_of(page):
        session = Page(page)
        try:
            for _ in range(runs):  # a page of Python only runs twice: rerunnable as written
                for block in blocks:
                    session.run(block)
                session.new_interpreter()
        finally:
            session.close()


#: a port a page's commands name (``redis-server --port 6390``, ``127.0.0.1:6390``)
PORT = re.compile(r"(?:127\.0\.0\.1:|--port |-p )(\d{4,5})\b")


@contextlib.contextmanager
def fixed_ports_of(page: Path) -> Iterator[None]:
    """Hold a lock on each fixed port the page names, machine-wide, while it runs: pages
    that name the same port (in one test session, or in two sessions on one machine)
    would otherwise start and shut down each other's servers."""
    ports = sorted({int(p) for p in PORT.findall(page.read_text(encoding="utf-8"))})
    with contextlib.ExitStack() as stack:
        for port in ports:  # in order: two pages never wait for each other in a cycle
            lock = Path(tempfile.gettempdir()) / f"qps-docs-port-{port}.lock"
            f = stack.enter_context(open(lock, "a"))
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


# ------------------------------------------------------------------- the runner itself


def test_output_matching_lets_numbers_differ_and_nothing_else() -> None:
    page = "restored ckpt/model-601 (global step 601, 4 variable(s))\nW1  float32  [64,128]"
    assert output_mismatch(page, "restored ckpt/model-1200 (global step 1200, 4 variable(s))\n"
                           "W1    float32   [64,128]") is None  # fmt: skip
    assert output_mismatch(page, "restored ckpt/model-601 (global step 601, 4 variable(s))\n"
                           "W1  float64  [64,128]")  # fmt: skip
    assert output_mismatch("test accuracy 0.97", "test accuracy -")
    assert (
        output_mismatch("generation 66c74e2a3267be97 (v 0)", "generation 0f3a9e21bb (v 4)") is None
    )
    assert output_mismatch("train-...: 2 shards", "train-2026-3ab6: 2 shards") is None
    assert output_mismatch("job 3ab6", "job 3ab7") is not None  # too short for an id
    # a random id may come out all decimal digits, or all letters a-f
    demo = "queue:    demo/demo-4d31ed67, FIFOQueue capacity 256"
    for made in ("12345678", "abcdefab", "0e123456"):
        assert output_mismatch(demo, demo.replace("4d31ed67", made)) is None, made
    assert output_mismatch(demo, demo.replace("4d31ed67,", "4d31ed67")) is not None
    assert output_mismatch("moved 1,499 of 2,000", "moved 13,837 of 2,000,000") is None
    assert output_mismatch("a\n...\nz 3", "a\nb c d\ne\nz 4") is None
    assert output_mismatch("a\n...\nz", "a b c") is not None
    # an array wraps where its numbers' widths say
    assert output_mismatch("[ 0.1 -0.2\n  0.3]", "[-0.1  0.25 0.3]") is None
    assert output_mismatch("[ 0.1 -0.2\n  0.3]", "[-0.1  0.25]") is not None


def test_commands_and_console_split_as_a_reader_reads_them() -> None:
    assert _commands("a \\\n  b\n# note\n\nc &\n") == ["a    b", "c &"]
    assert _commands("for k in 1 2; do\n  echo $k\ndone\n") == [
        "for k in 1 2; do\n  echo $k\ndone\n"
    ]
    assert _console("$ qps a \\\n  --b\nout 1\nout 2\n$ qps c\n") == [
        ("qps a  --b", "out 1\nout 2"),
        ("qps c", ""),
    ]


def test_a_page_session_keeps_state_and_reports_failures(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```sh\nX=41\nexport Y=1\nsleep 600 &\n```\n\n"
        "```console\n$ echo $((X + Y)) $Y\n42 1\n```\n\n"
        '```python title="mod.py"\nVALUE = 7\n```\n\n'
        "```python\nimport mod\nz = mod.VALUE\n```\n\n"
        "```python\nimport asyncio\nev = asyncio.Event()\nt = asyncio.ensure_future(ev.wait())\n"
        "await asyncio.sleep(0)\nprint(z * 6)\n```\n\n"
        "```python\nassert not t.done()\n```\n\n"
        "```python\nawait asyncio.sleep(0)\nev.set()\n```\n\n"
        "```python\nawait asyncio.wait_for(t, 10)  # the task went on between blocks\n```\n\n"
        "```sh\n# illustration only: never runs\nexit 3\n```\n\n"
        "```console\n$ echo 42 words\n42 numbers\n```\n",
        encoding="utf-8",
    )
    blocks = parse(page)
    assert [b.illustration for b in blocks][8] == "never runs"
    session = Page(page, timeout=60)
    try:
        for block in blocks[:-1]:
            session.run(block)
        with pytest.raises(BlockFailed, match="parts from the page"):
            session.run(blocks[-1])
        with pytest.raises(BlockFailed, match="exited 3"):
            session.run(parse_one(tmp_path, "```sh\ntrue\n(exit 3)\n```\n"))
        with pytest.raises(BlockFailed, match="ZeroDivisionError"):
            session.run(parse_one(tmp_path, "```python\n1 / 0\n```\n"))
    finally:
        session.close()
    assert not session.dir.exists()


def parse_one(tmp_path: Path, text: str) -> object:
    page = tmp_path / "one.md"
    page.write_text(text, encoding="utf-8")
    (block,) = parse(page)
    return block


def test_a_text_block_right_after_python_is_its_output(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint('value', 6 * 7)\n```\n\n```text\nvalue 41\n```\n\n"
        "```python\nprint('x')\n```\n\nprose between\n\n```text\nnot an output\n```\n\n"
        "```python\nprint('values', 42)\n```\n```text\nvalue 42\n```\n",
        encoding="utf-8",
    )
    first, _, second, _, third, _ = parse(page)
    assert (first.output, second.output, third.output) == ("value 41\n", None, "value 42\n")
    session = Page(page, timeout=60)
    try:
        session.run(first)  # numbers may differ
        session.run(second)
        with pytest.raises(BlockFailed, match="parts from the page"):
            session.run(third)
    finally:
        session.close()
