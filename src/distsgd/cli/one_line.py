"""argparse with every mistake said in one line on standard error (the cause, then where the
fix is), exit code 2; a value that is not one of the choices names the closest one."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

_LEFT_BY = "_one_line_left_by"
"""The namespace attribute naming the (sub)command whose arguments were left unread."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, without the usage block:
    ``distsgd run: error: argument --scheme: invalid choice: 'hogwld' (did you mean
    'hogwild'?); see distsgd run --help``. Subcommand parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self._fail(self.prog, message)

    def _fail(self, prog: str, message: str) -> NoReturn:
        self.exit(2, f"{prog}: error: {message}; see {prog} --help\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """As argparse's, noting in the namespace which (sub)command left arguments unread:
        the innermost one does so first, and its parent copies the note."""
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and not hasattr(parsed, _LEFT_BY):
            setattr(parsed, _LEFT_BY, self.prog)
        return parsed, extras

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """As argparse's, but arguments no parser took are blamed on the subcommand that was
        given them (``distsgd run: error: unrecognized arguments: --bogus; see distsgd run
        --help``), not on ``distsgd``."""
        parsed, extras = self.parse_known_args(args, namespace)
        prog = vars(parsed).pop(_LEFT_BY, self.prog)
        if extras:
            self._fail(prog, f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is not None and value not in choices:
            names = [str(c) for c in choices]
            close = difflib.get_close_matches(str(value), names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(names)}"
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} ({hint})")
        super()._check_value(action, value)
