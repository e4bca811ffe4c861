"""Files a user hands us (traces, step profiles, calibrations, GPU and model files): one error
type for whatever is wrong with them, and the checks every reader applies at the boundary.

A bad file must end in one line that names the file, the line and the problem (the CLI prints it
and exits 2), never in a traceback, and never in memory or time sized by a number in the file. So:
- text is read line by line as UTF-8 (a leading BOM allowed), each line at most MAX_LINE_BYTES;
  bytes that are not UTF-8 are refused with the line they are on;
- JSON is Python's reader with its holes closed: nesting deep enough to exhaust the recursion
  limit, integers of more than MAX_DIGITS digits (Python refuses past 4300 anyway, with a
  ValueError of its own) and an object with a key twice (Python keeps the last) are errors like
  any other syntax error; a number past a float's range (1e400) is named as such, not as the
  Infinity Python makes of it;
- a record's fields are checked one by one (`Fields`): the type, finite numbers (Python's reader
  takes NaN, Infinity and 1e400, which JSON does not allow), integers within explicit bounds."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_LINE_BYTES = 64 << 20  # a trace line of 10M tokens' hash_ids at block size 16 is ~6 MB
MAX_DIGITS = 30  # the longest integer literal read; 2**63 has 19 digits
_BOM = b"\xef\xbb\xbf"
_MISSING = object()


class BadInputFile(ValueError):
    """A file that cannot be used as given; `str()` is the one line a user sees:
    `trace.jsonl:17: input_length is NaN`."""

    def __init__(self, path: str | Path, problem: str, line: int | None = None) -> None:
        self.path, self.problem, self.line = Path(path), problem, line
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}")


def text_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, line with its newline) of a UTF-8 text file, one line in memory at a time."""
    number = 0
    try:
        with open(path, "rb") as f:
            while raw := f.readline(MAX_LINE_BYTES + 1):
                number += 1
                if len(raw) > MAX_LINE_BYTES:
                    raise BadInputFile(path, f"line longer than {MAX_LINE_BYTES >> 20} MiB", number)
                if number == 1:
                    raw = raw.removeprefix(_BOM)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    problem = f"not UTF-8 text (byte {raw[exc.start]:#04x}): a binary file?"
                    raise BadInputFile(path, problem, number) from None
                if "\x00" in text:
                    raise BadInputFile(path, "a NUL byte: a binary file?", number)
                yield number, text
    except OSError as exc:
        raise BadInputFile(path, f"cannot read ({exc.strerror or exc})") from None


def read_text(path: str | Path) -> str:
    """The whole of a small UTF-8 text file (a GPU list, a calibration, a config.json)."""
    return "".join(line for _, line in text_lines(path))


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


class _OutOfRange(float):
    """A number literal past a float's range (1e400): infinite, and remembering how it was
    written, so that a message says "out of range" rather than "Infinity"."""

    text: str

    def __new__(cls, value: float, text: str) -> _OutOfRange:
        number = super().__new__(cls, value)
        number.text = text
        return number


def _float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _OutOfRange(value, text)


def _object(pairs: list[tuple[str, object]]) -> dict:
    data = dict(pairs)
    if len(data) != len(pairs):  # a key twice: which value the writer meant is unknown
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"the key {key!r} appears twice in an object")
            seen.add(key)
    return data


def parse_json(text: str, path: str | Path, line: int | None = None) -> object:
    """A JSON document; NaN and infinities come back as floats for `Fields` to name."""
    try:
        return json.loads(text, parse_int=_integer, parse_float=_float, object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        # In a JSONL file `line` is the record's line; a whole-file document has its own lines.
        where = line if line is not None else exc.lineno
        raise BadInputFile(path, f"not JSON: {exc.msg} (column {exc.colno})", where) from None
    except RecursionError:
        raise BadInputFile(path, "not JSON we read: nested too deeply", line) from None
    except ValueError as exc:  # _integer's, _object's
        raise BadInputFile(path, f"not JSON we read: {exc}", line) from None


def read_json(path: str | Path) -> object:
    """A whole file as one JSON document."""
    text = read_text(path)
    if not text.strip():
        raise BadInputFile(path, "the file is empty")
    return parse_json(text, path)


def _show(value: object) -> str:
    """A value as the file spells it (true, null, NaN, Infinity), cut short."""
    if isinstance(value, _OutOfRange):
        text = f"{value.text} (out of range)"
        return text if len(text) <= 40 else text[:37] + "..."
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):  # YAML can hold what JSON cannot
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _non_finite(key: str, value: float) -> str:
    if isinstance(value, _OutOfRange):  # "timestamp 1e400 is out of range"
        return f"{key} {value.text[:40]} is out of range"
    return f"{key} is {_show(value)}"


@dataclass(slots=True)
class Fields:
    """One record (a JSON object) whose fields are read with their checks; each failure is a
    BadInputFile naming the file, the line and the field."""

    data: dict
    path: Path
    line: int | None = None
    what: str = ""  # prefixes field names in messages, e.g. "GPU 'L4': "

    @staticmethod
    def of(value: object, path: str | Path, line: int | None = None, what: str = "") -> Fields:
        if not isinstance(value, dict):
            raise BadInputFile(path, f"{what}expected a JSON object, not {_show(value)}", line)
        return Fields(value, Path(path), line, what)

    def error(self, problem: str) -> BadInputFile:
        return BadInputFile(self.path, f"{self.what}{problem}", self.line)

    def _get(self, key: str, default: object) -> object:
        value = self.data.get(key, default)
        if value is _MISSING:
            raise self.error(f"missing {key}")
        return value

    def integer(self, key: str, low: int, high: int, default: object = _MISSING) -> int:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value  # type: ignore[return-value]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            if isinstance(value, float) and not math.isfinite(value):
                raise self.error(_non_finite(key, value))  # "input_length is NaN"
            raise self.error(f"{key} must be an integer from {low} to {high}, not {_show(value)}")
        return value

    def number(self, key: str, low: float, high: float, default: object = _MISSING) -> float:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value  # type: ignore[return-value]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(f"{key} must be a number, not {_show(value)}")
        if not math.isfinite(value):
            raise self.error(_non_finite(key, value))
        if not low <= value <= high:
            raise self.error(f"{key} must be from {low:g} to {high:g}, not {_show(value)}")
        return float(value)

    def text(self, key: str, default: object = _MISSING) -> str | None:
        value = self._get(key, default)
        if value is None or isinstance(value, str):
            return value
        raise self.error(f"{key} must be a string, not {_show(value)}")

    def integers(self, key: str, low: int, high: int) -> list[int]:
        value = self._get(key, [])
        if not isinstance(value, list):
            raise self.error(f"{key} must be a list of integers, not {_show(value)}")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int) or not low <= item <= high:
                raise self.error(
                    f"{key} must hold integers from {low} to {high}, not {_show(item)}"
                )
        return value

    def mapping(self, key: str) -> Fields:
        return Fields.of(self._get(key, _MISSING), self.path, self.line, f"{self.what}{key}: ")
