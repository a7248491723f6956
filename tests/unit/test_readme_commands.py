"""The commands the README prints parse as the CLI reads them, and name a command a new
shell in the repository directory finds (`scripts/run ...`, not a bare `vllm-gateway`)."""

from __future__ import annotations

import os
import re
import shlex

import click

from vllm_gateway.cli.main import main

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def code_blocks(language: str) -> list[str]:
    with open(README) as f:
        text = f.read()
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def shell_lines() -> list[str]:
    lines = []
    for block in code_blocks("sh"):
        joined = block.replace("\\\n", " ")
        lines += [line.strip() for line in joined.splitlines() if line.strip()]
    return lines


def test_readme_shell_commands_are_found_and_parse():
    runs = 0
    for line in shell_lines():
        words = shlex.split(line, comments=True)
        assert words[0] != "vllm-gateway", f"not on a new shell's PATH: {line}"
        if words[0] != "scripts/run":
            assert words[0] in ("scripts/test", "curl", "export"), line
            continue
        runs += 1
        command: click.Command = main
        args = [w for w in words[1:] if w != ">>"]
        while isinstance(command, click.Group) and args and args[0] in command.commands:
            command = command.commands[args.pop(0)]
        assert not isinstance(command, click.Group), f"no such command: {line}"
        if ">>" in words:  # a redirection is the shell's, not the command's
            args = args[: args.index(words[words.index(">>") + 1])]
        command.make_context(command.name or "", args)  # raises on an unknown option
    assert runs >= 8


def test_readme_python_compiles():
    [snippet] = code_blocks("python")
    compile(snippet, "README.md", "exec")
