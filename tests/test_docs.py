"""The documentation site: `mkdocs build --strict` passes (broken links and anchors fail
it), the generated CLI reference is up to date and names every command and option of the
click tree, the migration guide covers every `qps.__all__` name that has a TensorFlow
counterpart, and the commands the quickstart shows parse against the real CLI."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

import qps
from qps.cli import _docgen
from qps.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REFERENCE = DOCS / "cli-reference.md"

#: Names exported by `qps` that have no TensorFlow 1.x counterpart. A new export must be
#: either mapped in docs/migration.md or listed here (and in the guide's section on them).
NO_TF_COUNTERPART = {"QueueSpec", "QueueStats", "StaleTokenError", "VariableValue"}


def _mkdocs_missing() -> str | None:
    for module in ("mkdocs", "material"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[dev]' brings mkdocs and mkdocs-material)"
    return None


#: A strict build takes ~10 s on an idle 2-core machine and minutes beside CPU hogs:
#: each build may take 300 s, and a test that builds twice gets the whole of both.
MKDOCS = pytest.mark.timeout(700)


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(config.parent),
    )  # fmt: skip


def _click_paths(command: click.Command, path: str) -> list[tuple[str, click.Command]]:
    """Every (command path, command) of the tree, found through click's own registry."""
    out = [(path, command)]
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            if not sub.hidden:
                out += _click_paths(sub, f"{path} {name}")
    return out


def _sections(text: str) -> dict[str, str]:
    """The reference's sections by command path (from the `### `qps ...`` headings)."""
    parts = re.split(r"^#{2,6} `(qps(?: [a-z0-9_-]+)*)`$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


# ------------------------------------------------------------------------------- mkdocs


@MKDOCS
def test_mkdocs_build_strict_passes(tmp_path: Path) -> None:
    missing = _mkdocs_missing()
    if missing:
        pytest.skip(missing)
    out = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for page in ("index.html", "quickstart/index.html", "concepts/index.html",
                 "migration/index.html", "cli-reference/index.html"):  # fmt: skip
        assert (tmp_path / "site" / page).is_file(), page
    html = (tmp_path / "site" / "cli-reference" / "index.html").read_text(encoding="utf-8")
    assert 'id="qps-ps-dlq-show"' in html


@MKDOCS
def test_strict_build_rejects_a_broken_anchor_but_not_a_page_outside_the_nav(
    tmp_path: Path,
) -> None:
    """The validation settings in mkdocs.yml: a link to a missing anchor fails the build;
    a page that exists but is not in the nav (pages other work adds) does not."""
    missing = _mkdocs_missing()
    if missing:
        pytest.skip(missing)
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    (docs / "not-in-nav.md").write_text("# Not in the nav\n\nSee [concepts](concepts.md).\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), encoding="utf-8")

    out = _mkdocs_build(config, tmp_path / "site")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    with open(docs / "quickstart.md", "a", encoding="utf-8") as f:
        f.write("\n[modes](concepts.md#no-such-section)\n")
    out = _mkdocs_build(config, tmp_path / "site2")
    assert out.returncode != 0
    log = out.stdout + out.stderr
    assert "no-such-section" in log
    assert "not-in-nav.md" not in "\n".join(
        line for line in log.splitlines() if line.startswith("WARNING")
    )


# -------------------------------------------------------------------------- CLI reference


def test_cli_reference_is_up_to_date() -> None:
    assert REFERENCE.read_text(encoding="utf-8") == _docgen.render(), (
        "docs/cli-reference.md is out of date: run python -m qps.cli._docgen"
    )


def test_reference_is_what_the_cli_accepts_whatever_ran_before(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The reference is rendered with the commands' context settings (``-h`` as well as
    ``--help``), not with what an earlier invocation happened to leave cached."""
    from qps.cli.main import run

    before = _docgen.render()
    assert run(["queue", "ls", "-h"]) == 0  # -h works below the top level too
    assert "Usage: qps queue ls" in capsys.readouterr().out
    assert _docgen.render() == before
    sections = _sections(before)
    assert all("- `-h, --help`" in body for body in sections.values())


def test_docgen_check_and_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ref.md"
    assert _docgen.main(["--check", str(path)]) == 1  # missing
    assert _docgen.main([str(path)]) == 0
    assert _docgen.main(["--check", str(path)]) == 0
    path.write_text(path.read_text(encoding="utf-8").replace("qps worker", "qps wurker", 1))
    assert _docgen.main(["--check", str(path)]) == 1
    assert "out of date" in capsys.readouterr().err


def test_every_command_and_option_is_in_the_reference() -> None:
    text = REFERENCE.read_text(encoding="utf-8")
    sections = _sections(text)
    tree = _click_paths(cli, "qps")
    assert len(tree) > 30  # the whole tree was walked, groups and subcommands
    assert {p for p, _ in tree} == set(sections)
    assert _docgen.command_paths(cli) == list(sections)  # in the reference's order
    for path, command in tree:
        body = sections[path]
        assert f"Usage: {path}" in body, path
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                for opt in param.opts:
                    assert f"`{opt}" in body or f", {opt}" in body, (path, opt)
            elif isinstance(param, click.Argument):
                assert param.human_readable_name in body, (path, param.name)


def test_reference_shows_env_vars_and_defaults() -> None:
    sections = _sections(REFERENCE.read_text(encoding="utf-8"))
    # explicit env vars, auto ones (QPS_<COMMAND>_<OPTION>) and defaults
    assert "env `QPS_REDIS_URL`" in sections["qps queue ls"]
    assert "env `QPS_QUEUE_PEEK_N`" in sections["qps queue peek"]
    assert "env `QPS_PS_DLQ_SHOW_JSON`" in sections["qps ps dlq show"]
    assert re.search(r"`--log-level [^`]*` \(env `QPS_LOG_LEVEL`; default `WARNING`\)",
                     sections["qps"])  # fmt: skip
    assert "default `10000`" in sections["qps ps"]  # --lease-ms


def test_auto_env_var_names_are_what_click_reads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reference's QPS_<COMMAND>_<OPTION> names are the ones the CLI really reads."""
    from qps.cli.main import run

    monkeypatch.setenv("QPS_REDIS_URL", "redis://127.0.0.1:1/0")  # never reached
    monkeypatch.setenv("QPS_QUEUE_PEEK_N", "not-a-number")
    assert run(["queue", "peek", "somequeue"]) == 2  # click rejects the env value: usage
    assert "not-a-number" in capsys.readouterr().err


# ------------------------------------------------------------------------ migration guide


def test_migration_guide_covers_every_export_with_a_tf_counterpart() -> None:
    text = (DOCS / "migration.md").read_text(encoding="utf-8")
    exported = set(qps.__all__)
    stale = NO_TF_COUNTERPART - exported
    assert not stale, f"NO_TF_COUNTERPART names no longer exported: {stale}"
    missing = [
        name
        for name in sorted(exported - NO_TF_COUNTERPART)
        if not re.search(rf"`(?:await )?qps\.{re.escape(name)}(?![A-Za-z0-9_])", text)
    ]
    assert not missing, f"docs/migration.md maps no TF API to: {missing}"
    section = text.split("## Names in `qps` without a TF counterpart", 1)[1].split("\n## ", 1)[0]
    for name in NO_TF_COUNTERPART:
        assert f"`qps.{name}`" in section, name


def test_migration_guide_lists_the_port_decisions() -> None:
    text = (DOCS / "migration.md").read_text(encoding="utf-8")
    section = text.split("## Where qps departs from TF 1.x on purpose", 1)[1].split("\n## ", 1)[0]
    numbers = [int(n) for n in re.findall(r"^(\d+)\. \*\*", section, flags=re.M)]
    assert numbers == list(range(1, 10))


# ----------------------------------------------------------------------------- quickstart


def _quickstart_commands() -> list[list[str]]:
    """The `qps ...` command lines in the quickstart's code blocks, as argv lists."""
    text = (DOCS / "quickstart.md").read_text(encoding="utf-8")
    commands = []
    for lang, block in re.findall(r"^```(sh|console)\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.splitlines():
            if lang == "console":  # commands have a prompt; the rest is their output
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line.startswith("qps "):
                continue
            argv = shlex.split(line.split(">", 1)[0].rstrip(" &"))
            commands.append(argv[1:])
    return commands


def _leftover_command(ctx: click.Context) -> list[str]:
    # click >= 8.2 keeps the subcommand's name in _protected_args (protected_args warns)
    if hasattr(ctx, "_protected_args"):
        return list(ctx._protected_args)
    return list(ctx.protected_args)


def test_quickstart_commands_parse_against_the_cli() -> None:
    commands = _quickstart_commands()
    assert len(commands) >= 10
    seen = set()
    for argv in commands:
        command: click.Command = cli
        path = ["qps"]
        rest = list(argv)
        while isinstance(command, click.Group) and rest and rest[0] in command.commands:
            command = command.commands[rest[0]]
            path.append(rest.pop(0))
        # parses options and arguments as a run would (usage errors raise), runs nothing
        ctx = command.make_context(" ".join(path), rest)
        if isinstance(command, click.Group):  # nothing left over for a subcommand
            assert not ctx.args and not _leftover_command(ctx), argv
        seen.add(" ".join(path))
    for path in ("qps train", "qps checkpoint restore", "qps var ls", "qps ps", "qps worker",
                 "qps job status", "qps job stop", "qps queue ls"):  # fmt: skip
        assert path in seen, path
