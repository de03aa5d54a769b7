"""The docs stay true: the site builds without warnings, and the Python examples run.

Every ```python block of every page (README.md and docs/*.md, but ``NOT_RUN``) runs, in
order, in one fresh interpreter per page (blocks share names like notebook cells) with
nothing injected: no simulated devices, no path or flag the page does not set itself, so
a page that needs 8 CPU devices says how in its first block, as a user would. A block
directly followed by a ```text block must print exactly that text; a block written as a
doctest (``>>>`` lines) must print what its lines show.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Pages whose python blocks cannot run in one interpreter, and why.
NOT_RUN = {"docs/multiprocess.md": "one copy per process, with its process id i (tests/test_multiprocess.py runs it)"}
EXECUTED_PAGES = tuple(
    page
    for page in ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")))]
    if "```python" in (ROOT / page).read_text() and page not in NOT_RUN
)
# A fenced block: its language and body; the text between blocks must be blank for an
# output block to belong to the code block before it.
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)

# Runs the blocks of one page in one namespace, capturing each block's stdout.
RUNNER = """
import contextlib, doctest, io, json, sys
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
printed = []
for index, source in enumerate(blocks):
    buffer = io.StringIO()
    if source.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(source, namespace, f"block {index}", None, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
        with contextlib.redirect_stdout(buffer):
            runner.run(test, out=buffer.write, clear_globs=False)
        namespace.update(test.globs)  # the doctest ran in a copy of the page's names
        if runner.failures:
            sys.exit(f"block {index} (doctest) failed:\\n" + buffer.getvalue())
    else:
        with contextlib.redirect_stdout(buffer):
            exec(compile(source, f"<block {index}>", "exec"), namespace)
    printed.append(buffer.getvalue())
print(json.dumps(printed))
"""


def code_blocks(text: str) -> list[tuple[str, str | None]]:
    """(python source, expected output or None) for every python block of a Markdown page."""
    fences = list(FENCE.finditer(text))
    blocks = []
    for i, fence in enumerate(fences):
        if fence.group(1) != "python":
            continue
        following = fences[i + 1] if i + 1 < len(fences) else None
        expected = None
        if following and following.group(1) == "text" and not text[fence.end() : following.start()].strip():
            expected = following.group(2)
        blocks.append((fence.group(2), expected))
    return blocks


def run_blocks(sources: list[str]) -> list[str]:
    """Each block's stdout, run in order in a fresh interpreter with nothing injected (the
    test process's simulated devices and platform choice are not passed on)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's package, as an installed one would be found
    result = subprocess.run(
        [sys.executable, "-c", RUNNER],
        check=False,
        input=json.dumps(sources),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_every_page_with_python_runs_or_says_why_not() -> None:
    assert {"README.md", "docs/concepts.md", "docs/inference.md", "docs/torch_interop.md"} <= set(EXECUTED_PAGES)
    assert all("```python" in (ROOT / page).read_text() for page in NOT_RUN)


def test_fences_are_found() -> None:
    page = "x\n```python\nprint(1)\n```\n\n```text\n1\n```\n```python\npass\n```\n```text\nalone\n```\n"
    assert code_blocks(page) == [("print(1)\n", "1\n"), ("pass\n", "alone\n")]
    assert code_blocks("```python\na = 1\n```\nprose\n```text\n1\n```\n") == [("a = 1\n", None)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", EXECUTED_PAGES)
def test_python_blocks_run_and_print_what_the_page_says(page: str) -> None:
    path = ROOT / page
    if not path.exists():
        pytest.fail(f"{page} is missing")
    blocks = code_blocks(path.read_text())
    assert blocks, f"{page} has no python blocks"
    printed = run_blocks([source for source, _ in blocks])
    for (source, expected), output in zip(blocks, printed):
        if expected is not None:
            assert output.rstrip() == expected.rstrip(), f"{page}: the block\n{source}\nprinted\n{output}"


@pytest.mark.timeout(300)
def test_site_builds_strict_without_warnings(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs and mkdocstrings[python] are not installed (extra 'docs')")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output
    assert (tmp_path / "site" / "api" / "index.html").exists()


CONSOLE_PAGES = ("docs/cli.md",)


def console_sessions(text: str) -> list[tuple[list[str], str]]:
    """(argv, printed text) for each ``$ placements2jax ...`` line of the ```console blocks
    of a page: the lines up to the next ``$`` line (an ``$ echo $?`` line and its output
    belong to the command before it)."""
    sessions = []
    for fence in FENCE.finditer(text):
        if fence.group(1) != "console":
            continue
        for chunk in re.split(r"^(?=\$ )", fence.group(2), flags=re.MULTILINE):
            command, _, printed = chunk.partition("\n")
            if command.startswith("$ placements2jax "):
                sessions.append((shlex.split(command[len("$ placements2jax ") :]), printed))
    return sessions


@pytest.mark.parametrize("page", CONSOLE_PAGES)
def test_cli_examples_print_what_the_page_says(page: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every ``$ placements2jax`` command of the page prints exactly what the page shows
    (stdout, then stderr), run in-process through the CLI's main."""
    from placements2jax.__main__ import main

    sessions = console_sessions((ROOT / page).read_text())
    assert sessions, f"{page} shows no placements2jax command"
    for argv, printed in sessions:
        if argv[0] in ("demo", "train"):  # whole training runs: tests/test_demo.py checks their output
            continue
        code = main(argv)
        out, err = capsys.readouterr()
        expected = printed.split("$ echo $?")[0]
        assert (out + err).rstrip() == expected.rstrip(), f"{page}: placements2jax {' '.join(argv)}"
        if "$ echo $?" in printed:
            assert str(code) == printed.split("$ echo $?\n")[1].strip()
