"""bench.cli: the `hetbench` console script dispatches to each command's own main."""

from __future__ import annotations

import pytest

from bench import cli


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"  {name}" in out


def test_an_unknown_command_is_one_line_naming_it_and_the_choices(capsys):
    assert cli.main(["plot"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'plot'" in err and "compare" in err and "\n" not in err


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_each_command_has_a_working_help(command, capsys):
    try:
        code = cli.main([command, "--help"])
    except SystemExit as exc:  # argparse's --help exits 0
        code = exc.code
    assert code == 0
    assert capsys.readouterr().out.strip()


def test_every_command_module_exists_and_has_a_main():
    import importlib

    for module, _ in cli.COMMANDS.values():
        assert callable(importlib.import_module(module).main)
