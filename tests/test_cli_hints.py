"""A command-line mistake points at the help of the command it was made in."""

from __future__ import annotations

import pytest

from distsgd.cli.parser import build_parser, parse_argv


@pytest.mark.parametrize(
    ("argv", "prog", "extra"),
    [
        (["run", "--placment", "pack", "x.py"], "distsgd run", "--placment"),
        (["doctor", "run", "extra"], "distsgd doctor", "extra"),
        (["elastic", "join", "run", "extra"], "distsgd elastic join", "extra"),
        (["--bogus", "doctor", "run"], "distsgd", "--bogus"),  # the top level's own flag
    ],
)
def test_unrecognized_arguments_point_at_the_subcommands_help(
    argv: list[str], prog: str, extra: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_argv(build_parser(), argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == f"{prog}: error: unrecognized arguments: {extra}; see {prog} --help\n"


def test_the_emulators_command_points_at_its_subcommands_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from distsgd_emulate.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["hosts", "up", "3", "--bogus"])
    assert exited.value.code == 2
    prog = "distsgd-emulate hosts up"
    err = capsys.readouterr().err
    assert err == f"{prog}: error: unrecognized arguments: --bogus; see {prog} --help\n"


def test_a_good_command_line_leaves_no_note_behind() -> None:
    args = parse_argv(build_parser(), ["doctor", "run"])
    assert args.command == "doctor"
    assert not [name for name in vars(args) if name.startswith("_")]
