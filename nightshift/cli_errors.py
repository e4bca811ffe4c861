"""How a command ends on a mistake a user can fix (a bad file, a bad option): one line
`error: ...` on stderr and exit code 2, never a traceback. The readers raise BadInputFile (or a
domain error whose message names what is wrong); commands turn them into that line here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer

EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    """Print the error line; the caller raises what this returns (`raise fail(...) from None`)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


@contextmanager
def user_errors(*kinds: type[Exception]) -> Iterator[None]:
    """Inside: BadInputFile and the given error types become the error line and exit 2."""
    from workload.input_file import BadInputFile

    try:
        yield
    except (BadInputFile, *kinds) as exc:
        raise fail(str(exc)) from None
