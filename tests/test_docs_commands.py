"""Every `kvshare ...` command the docs show exists, with the flags they give it (README.md, docs/*.md)."""

import argparse
import pathlib
import re

import pytest

from kvshare.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
# a command line, not a module path (kvshare.keys) nor a ready line a process prints ("kvshare replica ready")
_INVOCATION = re.compile(r"(?<![\w./-])kvshare ([a-z][a-z-]*)(?![\w.])(?! ready)([^\n|;&#`]*)")


def code_text(markdown: str) -> list[str]:
    """Fenced blocks (one line each, continuations joined) and inline code spans."""
    blocks = [line for block in _FENCE.findall(markdown) for line in block.replace("\\\n", " ").splitlines()]
    return blocks + _SPAN.findall(_FENCE.sub("", markdown))


def invocations() -> list[tuple[str, str, list[str]]]:
    found = []
    for path in DOCS:
        for text in code_text(path.read_text()):
            for command, rest in _INVOCATION.findall(text):
                found.append((path.name, command, rest.split()))
    return found


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def test_the_docs_show_commands():
    assert len(invocations()) > 30


@pytest.mark.parametrize("doc, command, words", invocations(), ids=lambda v: v if isinstance(v, str) else None)
def test_a_documented_command_and_its_flags_exist(doc, command, words):
    """Fails on a command or flag the CLI does not have (operations.md's `kvshare router` did)."""
    parser = subparser(build_parser(), command)
    assert parser is not None, f"{doc}: `kvshare {command}` is no command"
    options = set()
    for word in words:
        options |= {option for action in parser._actions for option in action.option_strings} | {"--log-level"}
        if (nested := subparser(parser, word)) is not None:  # bench ttft, pool-admin --socket S flush
            parser = nested
            continue
        flag = re.match(r"--[a-z0-9-]+", word)
        if flag:
            options |= {option for action in parser._actions for option in action.option_strings}
            assert flag.group(0) in options, f"{doc}: `kvshare {command}` has no flag {flag.group(0)}"
