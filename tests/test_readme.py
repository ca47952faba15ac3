"""The README's Python example runs as written, on the built-in default model."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # all 24 example products, 48 tokens each, on the built-in model
def test_readme_python_example_runs(monkeypatch, capsys):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(import json.*?)```", text, re.S).group(1)
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    rows = sum(1 for line in (ROOT / "examples/products.jsonl").read_text().splitlines() if line.strip())
    assert len(namespace["done"]) + len(namespace["retry"]) == rows
    assert namespace["done"], "no marketing line finished on its own"
    assert all(isinstance(v, str) and v for v in namespace["done"].values())
    assert "lines ready" in capsys.readouterr().out


def test_readme_generate_line_prints_text(capsys):
    """The README's `tokenmill generate "..."` line, as a new user types it, prints a completion."""
    from tokenmill.cli import main

    line = re.search(r"^tokenmill generate .*$", (ROOT / "README.md").read_text(), re.M).group(0)
    argv = shlex.split(line.split("#")[0])[1:]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.strip(), f"{line!r} printed nothing (stderr: {captured.err[-500:]})"


def test_every_documented_command_line_parses():
    """Each `tokenmill ...` line of the README's and docs' shell blocks is one the CLI takes as written
    (flags, their arity and choices); the flag-by-flag check (test_batch_cli) cannot see a line that
    gives a flag the wrong number of values."""
    from tokenmill.cli_options import build_parser

    lines = []
    for name in ("README.md", "docs/batch.md", "docs/scale-out.md"):
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / name).read_text(), re.S):
            for command in (part.split(" #")[0].split(" < ")[0].strip() for line in block.splitlines() for part in line.split("&&")):
                if command.startswith("tokenmill "):
                    lines.append(command)
    assert len(lines) >= 20, lines
    parser = build_parser()
    for line in lines:
        try:
            parser.parse_args(shlex.split(line)[1:])
        except SystemExit:
            pytest.fail(f"the docs' command line does not parse: {line}")
