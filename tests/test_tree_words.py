"""The tree speaks of the product: code, comments, docs and results name what was run, on what hardware,
at which commit, never how the work was organised (numbered work sittings and their device calls, device
plans and budgets, tracker numbers). The domain's own words stay: multi-turn sessions ("session 0 turn 5",
X-Session-ID, `kvshare bench sessions`) and function calls.

Fails on the tree before docs/results was renamed by date and commit (commit b6aae56: 862 hits, e.g. the
numbered folder names of docs/results and "(issue 18)" in module docstrings).
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth"
WORDS = {
    "a numbered sitting": re.compile(r"\b[Ss]ession ?\d{1,2}\b(?! turn)(?!\.\d)|\b[Ss]ession\d"),
    "an ordinal sitting": re.compile(rf"\b({ORDINALS}) session\b", re.IGNORECASE),
    "the sitting's tree": re.compile(r"\bsession's tree\b", re.IGNORECASE),
    "a numbered device call": re.compile(r"\b[Cc]alls? \d|(?<![A-Za-z])call\d"),
    "a device plan or budget": re.compile(r"\bdevice (plan|time)\b", re.IGNORECASE),
    "a tracker number": re.compile(r"\bissues? ?#?\d+\b", re.IGNORECASE),
}
BINARY = (".png", ".whl", ".gz", ".tgz")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.splitlines() if not name.endswith(BINARY)]


def hits(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, pattern in WORDS.items() for m in pattern.finditer(text)]


def test_no_organisational_words_in_the_tree():
    found = []
    for path in tracked_files():
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{path.relative_to(ROOT)}: {hit}" for hit in hits(text)]
    advice = "rewrite them as what ran, where, at which commit"
    assert not found, f"{len(found)} organisational words; {advice}:\n" + "\n".join(found[:40])


@pytest.mark.parametrize(
    "text",
    [
        "the runs of session 13",
        "session12/README.md",
        "the tenth session's runs",
        "call 3 script",
        "call2.sh",
        "Device plan",
        "device time",
        "issue 18",
        "Issue #7",
        "session 13's tree",
    ],
)
def test_each_pattern_catches_its_word(text):
    assert hits(text)


@pytest.mark.parametrize(
    "text",
    [
        "| sessions | 32k | alternate/on | session 0 turn 5 |",
        "X-Session-ID",
        "kvshare bench sessions --session-contexts 32k",
        "tiny session 512",
        "the hook calls start_load_kv",
        "a multi-turn session",
        "sessions 32k, 128k",
        "most recent call last",
        "each ON sticky session 0.07-0.29 s longer",
        "2026-12-04-171c11f-h200-service-ttft run 3",
    ],
)
def test_domain_words_pass(text):
    assert not hits(text)
