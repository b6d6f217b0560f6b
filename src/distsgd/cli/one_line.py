"""argparse with every mistake said in one line on standard error (the cause, then where the
fix is), exit code 2; a value that is not one of the choices names the closest one."""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, without the usage block:
    ``distsgd run: error: argument --scheme: invalid choice: 'hogwld' (did you mean
    'hogwild'?); see distsgd run --help``. Subcommand parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is not None and value not in choices:
            names = [str(c) for c in choices]
            close = difflib.get_close_matches(str(value), names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(names)}"
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} ({hint})")
        super()._check_value(action, value)
