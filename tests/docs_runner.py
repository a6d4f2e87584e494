"""Run the code blocks of README.md and docs/*.md as a reader would (tests/test_docs_run.py).

A page's fenced blocks are classified by their info string:

* ``python``: executed, in order, in one interpreter per page (a persistent process, so a
  later block sees the names an earlier one defined; a block may ``await`` at top level,
  as in ``python -m asyncio``, whose loop keeps running the tasks a block leaves).
* ``sh``: every command executed, in order, in one ``bash`` per page (variables, ``cd`` and
  ``export`` carry over; ``&`` jobs keep running until the page ends); each must exit 0.
  A ``text`` block right after a ``python`` block (nothing but blank lines between) is
  what that block prints, compared as below.
* ``console``: ``$ command`` lines executed in that same shell; the lines after each are its
  expected output, compared with :func:`output_mismatch` (numbers may differ, ``...`` stands
  for anything). A non-zero status is expected only where the output shows ``error``.
* ``title="NAME"`` on any block: the block is written to the file NAME in the page's
  directory (a module or a config file the next commands use), not executed.
* a block whose first line is a comment ``# illustration only: REASON``: not executed.
* ``text`` (output, synopses, formulas, diagrams), ``toml``, ``yaml``, ``json``: not
  commands, nothing to run.

Each page runs in a fresh temporary directory which is also its ``TMPDIR`` (with links to
the checkout's ``bench`` and ``compose``, as a page's commands run from its root), so the local
embedded server of a page (``qps.connect()`` and the ``qps`` commands without a URL) is a
private one; the venv's ``bin`` comes first on ``PATH``. When a page ends, every process
started from it (the shell's jobs, and daemons whose working directory is the page's) is
killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE = {"python", "sh", "console"}
#: what a page's directory links to in the checkout: pages run commands from its root
CHECKOUT = ("bench", "compose")
INERT = {"text", "toml", "yaml", "json"}
ILLUSTRATION = re.compile(r"^(?:\$\s*)?#\s*illustration only\b:?\s*(.*)$", re.IGNORECASE)
FENCE = re.compile(r"^(\s*)```(.*)$")
TITLE = re.compile(r'\btitle="([^"]+)"')


@dataclass
class Block:
    path: Path
    line: int  #: 1-based line of the opening fence
    lang: str
    info: str
    text: str
    title: str | None = None
    illustration: str | None = None  #: the reason, for a block marked illustration only
    output: str | None = None  #: what a python block prints: the text block right after it
    end: int = 0  #: 1-based line of the closing fence

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def parse(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, in order (indented fences included)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info = m.group(1), m.group(2).strip()
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: a fence that is never closed")
        body = [
            ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : j]
        ]
        text = "\n".join(body) + "\n"
        title = TITLE.search(info)
        first = next((ln for ln in body if ln.strip()), "")
        mark = ILLUSTRATION.match(first.strip())
        blocks.append(
            Block(
                path=path,
                line=i + 1,
                lang=info.split()[0] if info else "",
                info=info,
                text=text,
                title=title.group(1) if title else None,
                illustration=(mark.group(1) or "no reason given") if mark else None,
                end=j + 1,
            )
        )
        if (
            blocks[-1].lang == "text"
            and len(blocks) > 1
            and blocks[-2].lang == "python"
            and blocks[-2].title is None
            and not "".join(lines[blocks[-2].end : i]).strip()
        ):
            blocks[-2].output = blocks[-1].text
        i = j + 1
    return blocks


# ------------------------------------------------------------------------ output matching

#: a number's sign is its own only where no word or number comes right before it
#: (``[-0.5``, `` -3``; not ``train-2026``)
#: (thousands separated by commas: "1,499"; a comma after a number is its own: "id 12345,")
_NUMBER = r"(?:(?<![\w.])[-+])?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?"
#: a hex id (a generation, a nonce) of 8 or more digits counts as a number, whatever
#: digits it happens to hold (all decimal: a number; all letters a-f: still an id)
_HEX = r"(?<!\w)[0-9a-f]{8,}(?!\w)"
_TOKEN = re.compile(rf"\.\.\.|{_HEX}|{_NUMBER}|\w+|[^\w\s]")
_NUM = re.compile(rf"[-+]?\d+(?:,\d{{3}})*(?:\.\d+)?(?:[eE][-+]?\d+)?|{_HEX}")
_SEP = "\x1f"


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def output_mismatch(expected: str, actual: str) -> str | None:
    """None where ``actual`` reads as ``expected``: the same words and punctuation in the
    same order, any number (or hex id) where the page shows one, and anything at all where it
    shows ``...``. Whitespace and line breaks do not count (a table's columns and an
    array's wrapping change with the numbers in them). Else a description of the first
    place where they part."""
    want = _tokens(expected)
    got = ["#" if _NUM.fullmatch(t) else t for t in _tokens(actual)]
    pattern = "".join(
        f"(?:[^{_SEP}]*{_SEP})*?"
        if t == "..."
        else ("#" if _NUM.fullmatch(t) else re.escape(t)) + _SEP
        for t in want
    )
    subject = "".join(t + _SEP for t in got)
    if re.fullmatch(pattern, subject, re.DOTALL):
        return None
    # the longest prefix of the expected tokens that still matches: where they part
    lo, hi = 0, len(want)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        prefix = "".join(
            f"(?:[^{_SEP}]*{_SEP})*?"
            if t == "..."
            else ("#" if _NUM.fullmatch(t) else re.escape(t)) + _SEP
            for t in want[:mid]
        )
        if re.match(prefix, subject, re.DOTALL):
            lo = mid
        else:
            hi = mid - 1
    context = " ".join(want[max(0, lo - 6) : lo + 6])
    return f"the output parts from the page at token {lo} ({want[lo] if lo < len(want) else 'end'!r}, near: {context!r})"


# ----------------------------------------------------------------------------- sessions


class BlockFailed(AssertionError):
    pass


#: a command that keeps printing may run this many times its limit
HARD_LIMITS = 4


@dataclass
class _Reader:
    stream: object
    lines: queue.Queue[str | None] = field(default_factory=queue.Queue)

    def start(self) -> None:
        def pump() -> None:
            for raw in iter(self.stream.readline, b""):  # type: ignore[attr-defined]
                self.lines.put(raw.decode("utf-8", "replace"))
            self.lines.put(None)

        threading.Thread(target=pump, daemon=True).start()


class Shell:
    """One ``bash`` for a page: commands run one at a time, each with its status."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["bash", "--norc", "--noprofile"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        self.reader = _Reader(self.proc.stdout)
        self.reader.start()
        self.n = 0

    def run(self, command: str, timeout: float) -> tuple[int, str]:
        """Run ``command`` (stdin from /dev/null, stderr into stdout); its status and output."""
        self.n += 1
        marker = f"__qps_docs_done_{self.n}__"
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            f"{{\n{command}\n}} </dev/null 2>&1\nprintf '\\n{marker} %s\\n' $?\n".encode()
        )
        self.proc.stdin.flush()
        out: list[str] = []
        # a command that prints as it goes (a training job's progress) may take longer
        # on a busy machine: the limit counts from its last line, up to HARD_LIMITS times
        start = time.monotonic()
        deadline = start + timeout
        while True:
            try:
                line = self.reader.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise BlockFailed(
                    f"still running after {time.monotonic() - start:.0f} s (the limit: "
                    f"{timeout:.0f} s without output, {HARD_LIMITS * timeout:.0f} s in all): "
                    f"{command}\n"
                    f"output so far:\n{''.join(out)}"
                ) from None
            if line is None:
                raise BlockFailed(f"the shell exited running: {command}\n{''.join(out)}")
            if line.startswith(marker):
                text = "".join(out)
                return int(line.split()[1]), text[:-1] if text.endswith("\n") else text
            out.append(line)
            deadline = min(time.monotonic() + timeout, start + HARD_LIMITS * timeout)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Python:
    """One interpreter for a page (tests/docs_pyexec.py): blocks run in one namespace."""

    def __init__(self, cwd: Path, env: dict[str, str], log: Path) -> None:
        self.log = log
        self.logf = open(log, "ab")  # noqa: SIM115 - closed in close()
        r, w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("docs_pyexec.py")), str(w)],
            stdin=subprocess.PIPE,
            stdout=self.logf,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            pass_fds=(w,),
            start_new_session=True,
        )
        os.close(w)
        self.replies = _Reader(os.fdopen(r, "rb"))
        self.replies.start()

    def run(self, block: Block, timeout: float) -> str:
        start = self.log.stat().st_size
        assert self.proc.stdin is not None
        request = {"code": block.text, "name": block.where}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        try:
            reply = self.replies.lines.get(timeout=timeout)
        except queue.Empty:
            raise BlockFailed(f"{block.where}: still running after {timeout:.0f} s") from None
        with open(self.log, "rb") as f:
            f.seek(start)
            output = f.read().decode("utf-8", "replace")
        if reply is None:
            raise BlockFailed(f"{block.where}: the interpreter exited\n{output}")
        result = json.loads(reply)
        if not result["ok"]:
            raise BlockFailed(f"{block.where}: raised\n{result['error']}\noutput:\n{output}")
        return output

    def close(self) -> None:
        """End the interpreter as a script ends (what it started shuts down cleanly),
        then kill what is left of its process group."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.logf.close()


def _commands(text: str) -> list[str]:
    """An ``sh`` block's commands: one per line, ``\\`` continuations joined; a block
    with a compound command (``for``, ``while``, ``if``, a function) is one command."""
    if re.search(r"^\s*(for|while|until|if|case)\b|\(\)\s*\{", text, re.MULTILINE):
        return [text]
    out: list[str] = []
    current = ""
    for line in text.split("\n"):
        current += line
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip() and not current.strip().startswith("#"):
            out.append(current)
        current = ""
    return out


def _console(text: str) -> list[tuple[str, str]]:
    """A ``console`` block's ``(command, expected output)`` pairs."""
    pairs: list[tuple[str, list[str]]] = []
    lines = text.rstrip("\n").split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            cmd = line[2:]
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].lstrip("> ")
            pairs.append((cmd, []))
        elif pairs:
            pairs[-1][1].append(line)
        else:
            raise ValueError(f"console output before any '$ ' command: {line!r}")
        i += 1
    return [(cmd, "\n".join(out)) for cmd, out in pairs]


class Page:
    """The session a page's blocks run in."""

    def __init__(self, path: Path, timeout: float = 600.0) -> None:
        self.path = path
        self.timeout = timeout
        self.dir = Path(tempfile.mkdtemp(prefix="qpsdoc-"))
        for name in CHECKOUT:  # commands written for a checkout's root (bench/...)
            (self.dir / name).symlink_to(ROOT / name)
        env = {k: v for k, v in os.environ.items() if not k.startswith("QPS_")}
        bindir = str(Path(sys.executable).parent)
        env.update(
            TMPDIR=str(self.dir),
            PATH=bindir + os.pathsep + env.get("PATH", ""),
            VIRTUAL_ENV=str(Path(bindir).parent),
            PYTHONPATH=os.pathsep.join([str(self.dir), str(ROOT)]),
            COLUMNS="100",
            PYTHONUNBUFFERED="1",
        )
        env.pop("PYTHONHOME", None)
        self.env = env
        self._shell: Shell | None = None
        self._python: Python | None = None
        self.ran = 0

    @property
    def shell(self) -> Shell:
        if self._shell is None:
            self._shell = Shell(self.dir, self.env)
        return self._shell

    @property
    def python(self) -> Python:
        """The page's interpreter, started (at its first block) from the page's shell
        as it is then: its exported variables and directory, as a reader's would be."""
        if self._python is None:
            env, cwd = self.env, self.dir
            if self._shell is not None:
                status, out = self._shell.run("env -0; printf '\\0%s' \"$PWD\"", self.timeout)
                if status == 0:
                    *pairs, cwd_text = out.split("\0")
                    env = dict(p.split("=", 1) for p in pairs if "=" in p)
                    cwd = Path(cwd_text)
            self._python = Python(cwd, env, self.dir / ".python.log")
        return self._python

    def run(self, block: Block) -> None:
        if block.illustration is not None or (block.lang not in RUNNABLE and block.title is None):
            return
        self.ran += 1
        if block.title is not None:
            (self.dir / block.title).parent.mkdir(parents=True, exist_ok=True)
            (self.dir / block.title).write_text(block.text, encoding="utf-8")
        elif block.lang == "python":
            out = self.python.run(block, self.timeout)
            why = None if block.output is None else output_mismatch(block.output, out)
            if why:
                raise BlockFailed(
                    f"{block.where}: {why}\n--- the page shows:\n{block.output}\n"
                    f"--- the block printed:\n{out}"
                )
        elif block.lang == "sh":
            for cmd in _commands(block.text):
                status, out = self.shell.run(cmd, self.timeout)
                if status != 0:
                    raise BlockFailed(f"{block.where}: `{cmd}` exited {status}\n{out}")
        else:
            for cmd, expected in _console(block.text):
                status, out = self.shell.run(cmd, self.timeout)
                if status != 0 and "error" not in expected:
                    raise BlockFailed(f"{block.where}: `{cmd}` exited {status}\n{out}")
                why = output_mismatch(expected, out)
                if why:
                    raise BlockFailed(
                        f"{block.where}: `{cmd}`: {why}\n--- the page shows:\n{expected}\n"
                        f"--- the command printed:\n{out}"
                    )

    def new_interpreter(self) -> None:
        """The next python block starts a new interpreter (the same page directory): a
        second run of a page reruns its script as a reader would, in a new process."""
        if self._python is not None:
            self._python.close()
            self._python = None

    def close(self) -> None:
        for session in (self._shell, self._python):
            if session is not None:
                session.close()
        _kill_under(self.dir)
        subprocess.run(["rm", "-rf", str(self.dir)], check=False)


def _kill_under(directory: Path) -> None:
    """SIGKILL every process of ours whose working directory is ``directory`` or below
    (daemons a page started, such as ``redis-server --daemonize yes``)."""
    base = str(directory)
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd == base or cwd.startswith(base + os.sep):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def main() -> None:
    """``python -m tests.docs_runner``: per page, the blocks run, the files written,
    those marked illustration only (with their reasons) and the inert ones."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    totals = {"run": 0, "file": 0, "illustration": 0, "inert": 0}
    for page in pages:
        if page.name == "cli-reference.md":  # generated from --help; tests/test_docs.py
            continue
        counts = dict.fromkeys(totals, 0)
        for b in parse(page):
            kind = (
                "illustration" if b.illustration is not None
                else "file" if b.title is not None
                else "run" if b.lang in RUNNABLE
                else "inert"
            )  # fmt: skip
            counts[kind] += 1
            if kind == "illustration":
                print(f"  illustration only: {b.where}: {b.illustration}")
        for k, v in counts.items():
            totals[k] += v
        print(f"{page.relative_to(ROOT)}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    print("all: " + ", ".join(f"{v} {k}" for k, v in totals.items()))


if __name__ == "__main__":
    main()
