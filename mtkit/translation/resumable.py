"""A long translation of a file into a file that survives being stopped: back-translating monolingual text,
translating a training corpus with a teacher.

The source is translated in parts of ``PART_LINES`` lines, each written whole (atomically) into a work
folder beside the output as soon as it is done, named by its first line. A run stopped at any moment
keeps every finished part; the next run translates only the parts that are missing, then joins them
into the output, which appears whole or not at all, with exactly as many lines as the source. A part
is trusted only if it has the lines its source range has, and only if the work folder was started
for the same translation: its ``made_from.json`` holds what the caller says the output is made from
(models, text, settings), and parts made from anything else are deleted. The work folder is removed
once the output is written. Sampling draws each part's samples from the seed plus the part's first line, so a part
translated after a stop is the part an uninterrupted run writes. A part that cannot be written (a full disk) is
an OutputError naming the part and the cause, never taken for an error of reading the source.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from mtkit.data.parallel import DataError, count_lines, iter_lines, reading
from mtkit.decoding.line_translator import LineTranslator, Translation, Translator
from mtkit.files import OutputError, atomic_write, atomic_write_text
from mtkit.progress import StageProgress

log = logging.getLogger("mtkit")

PART_LINES = 2_000  # a part is a minute or two of CPU decoding: what a stop can cost at most
MADE_FROM = "made_from.json"


def translate_resumably(
    translator: LineTranslator,
    source: Path,
    output: Path,
    what: str = "translating",
    part_lines: int = PART_LINES,
    on_part: Callable[[int], None] | None = None,
    render: Callable[[int, list[Translation]], str] | None = None,
    made_from: dict | None = None,
) -> int:
    """Translate ``source`` line by line into ``output`` (see the module docstring); the number of lines.

    ``render(index, hypotheses)`` makes the output line (without its newline) of the source line at ``index``
    (0-based) from its hypotheses, called in increasing ``index`` order; by default it is the best one's text.
    ``made_from`` (JSON data: the models, text and settings the output depends on) keeps the parts of an earlier
    run only if it was the same. ``on_part(first_line)`` is called after each part is written (tests stop a run
    there).
    """
    render = render or _best_text
    total = count_lines(source)
    if total is None:
        raise DataError(f"{source}: a file to translate in resumable parts must be a plain text file")
    work = parts_folder(output)
    made = json.dumps(made_from or {}, sort_keys=True)
    if work.is_dir() and _read_made_from(work) != made:
        log.info("%s: %s holds parts of another translation; translating afresh", what, work)
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / MADE_FROM).is_file():
        atomic_write_text(work / MADE_FROM, made)
    done = {first for first in range(0, total, part_lines) if _whole(work, first, min(part_lines, total - first))}
    if done:
        log.info("%s: %d of %d lines already translated in %s", what, len(done) * part_lines, total, work)
    with StageProgress(what, total=total, unit="lines") as bar, reading(source):
        bar.advance(sum(min(part_lines, total - first) for first in done))
        lines = iter_lines(source, allow_nul=True)
        for first in range(0, total, part_lines):
            chunk = list(itertools.islice(lines, part_lines))
            if first in done:
                continue
            part = translator.reseeded(first) if isinstance(translator, Translator) else translator
            rendered = (render(first + i, hyps) for i, hyps in enumerate(part.hypotheses(chunk)))
            text = "".join(line.replace("\n", " ") + "\n" for line in rendered).encode("utf-8")
            with writing(_part(work, first)):
                atomic_write(_part(work, first), lambda f, text=text: f.write(text))
            bar.advance(len(chunk))
            if on_part is not None:
                on_part(first)

    def join(f) -> None:
        for first in range(0, total, part_lines):
            with open(_part(work, first), "rb") as part:
                shutil.copyfileobj(part, f)

    atomic_write(output, join)
    written = count_lines(output)
    if written != total:  # a part changed under us: never hand on a misaligned corpus
        raise DataError(f"{output}: {written} lines written for the {total} of {source}")
    shutil.rmtree(work)
    return total


def parts_folder(output: Path) -> Path:
    """The work folder that keeps the finished parts of ``output``'s translation."""
    return output.with_name(f".{output.name}.parts")


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Errors of writing ``path`` (a full disk, a denied permission) as one OutputError naming it and the cause: not
    an OSError, so that an enclosing ``reading`` of an input does not blame the input."""
    try:
        yield
    except OSError as err:
        raise OutputError(f"{err.filename or path}: cannot write ({err.strerror or err})") from None


def _best_text(index: int, hypotheses: list[Translation]) -> str:
    return hypotheses[0].text


def _read_made_from(work: Path) -> str | None:
    try:
        return (work / MADE_FROM).read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None


def _part(work: Path, first: int) -> Path:
    return work / f"{first:012d}.txt"


def _whole(work: Path, first: int, lines: int) -> bool:
    """Whether the part starting at ``first`` was written and has its ``lines`` lines."""
    path = _part(work, first)
    return path.is_file() and count_lines(path) == lines
