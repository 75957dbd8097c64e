"""Lines in and out of ``mtkit translate``: input in chunks from files, pipes and terminals, output
that always ends with a whole line, the lines done kept when a signal stops the run, and progress.

Lines end at ``\\n`` only, never at other characters Python would split on (form feed, U+2028), so
the output keeps one line per input line as ``wc -l`` counts them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from mtkit.config import ConfigError, Engine, InferenceConfig, InferencePrecision, SamplingConfig
from mtkit.data.parallel import UTF8_BOM, DataError, check_input_file, count_lines, open_binary, reading
from mtkit.decoding import line_translator
from mtkit.decoding.line_translator import PrefixMismatch, Translation
from mtkit.files import atomic_write, check_output_file
from mtkit.model.loading import checkpoints_holding, with_model_files
from mtkit.progress import StageProgress, shows_bar
from mtkit.runtime import require
from mtkit.translation.engines import REFUSED_OPTIONS, load_translator, refused_options
from mtkit.translation.reranking import RerankSettings, load_reranker, reranked

log = logging.getLogger("mtkit")


def input_chunks(path: Path | None, chunk_lines: int) -> Iterator[list[str]]:
    """Input lines in chunks of up to ``chunk_lines``; invalid UTF-8 and NUL bytes are replaced, with a warning.

    Lines end at ``\\n`` only, never at other characters Python would split on (form feed, U+2028),
    so the output keeps one line per input line as ``wc -l`` counts them. A CR before the newline and
    a byte-order mark are dropped. On a pipe or terminal a chunk also ends whenever no more input is
    waiting, so an interactive producer gets its answers.
    """
    name = str(path) if path else "<stdin>"
    number = 0

    def decoded(raw_lines: list[bytes]) -> list[str]:
        nonlocal number
        out = []
        for raw in raw_lines:
            number += 1
            raw = raw.removesuffix(b"\r")
            if number == 1:
                raw = raw.removeprefix(UTF8_BOM)
            if b"\0" in raw:
                log.warning("%s:%d: NUL bytes replaced by spaces", name, number)
                raw = raw.replace(b"\0", b" ")
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                log.warning("%s:%d: invalid UTF-8 replaced", name, number)
                out.append(raw.decode("utf-8", errors="replace"))
        return out

    for raw_chunk in _raw_chunks(path, chunk_lines):
        yield decoded(raw_chunk)


def _raw_chunks(path: Path | None, chunk_lines: int) -> Iterator[list[bytes]]:
    if path is None:
        if sys.stdin is None:  # started with stdin closed (<&-)
            raise DataError("<stdin>: standard input is closed; give the text with -i FILE")
        try:
            fd = sys.stdin.fileno()
        except (AttributeError, OSError, ValueError):  # a stand-in stdin, as in tests
            fd = None
        if fd is not None and not os.path.isfile(f"/proc/self/fd/{fd}"):
            with reading("<stdin>"):
                yield from _ready_chunks(fd, chunk_lines)
            return
        with reading("<stdin>"):
            yield from _file_chunks(sys.stdin.buffer, chunk_lines)
        return
    with reading(path), open_binary(path) as f:  # translate checked it exists
        yield from _file_chunks(f, chunk_lines)


def _file_chunks(stream, chunk_lines: int) -> Iterator[list[bytes]]:
    chunk: list[bytes] = []
    for raw in stream:
        chunk.append(raw.removesuffix(b"\n"))
        if len(chunk) == chunk_lines:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _ready_chunks(fd: int, chunk_lines: int) -> Iterator[list[bytes]]:
    """Lines from a pipe or terminal, cut into a chunk when it is full or nothing more is waiting."""
    import select

    pending, lines = b"", []
    while True:
        if lines and (len(lines) >= chunk_lines or not select.select([fd], [], [], 0)[0]):
            yield lines[:chunk_lines]
            lines = lines[chunk_lines:]
            continue
        data = os.read(fd, 1 << 16)
        if not data:
            break
        *complete, pending = (pending + data).split(b"\n")
        lines.extend(complete)
    if pending:
        lines.append(pending)
    for start in range(0, len(lines), chunk_lines):
        yield lines[start : start + chunk_lines]


def format_translations(index: int, translations: list[Translation], nbest: int, scores: bool, aligned: bool) -> str:
    """The output line(s) of one input line; translations never contain a newline."""
    if nbest > 1:
        return "".join(
            f"{index} ||| {t.text.replace(chr(10), ' ')} ||| {t.score:.4f} ||| {t.logprob:.4f}\n" for t in translations
        )
    best = translations[0]
    text = best.text.replace("\n", " ") + (f" ||| {best.alignment}" if aligned else "")
    return f"{best.logprob:.4f}\t{text}\n" if scores else text + "\n"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM during translation; a KeyboardInterrupt, so ``atomic_write`` keeps the lines done."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.done = 0  # whole lines written before it came
        self.partial: Path | None = None  # where they are kept, when the output is a file
        super().__init__(self.name)


class WholeLines:
    """SIGINT and SIGTERM stop translation at once, except while a line is being written: then as soon as
    it is out. So the output (a file or a pipe) always ends with a complete line. Later signals are ignored
    while the lines done are being saved."""

    def __enter__(self) -> WholeLines:
        self._writing, self._pending, self._stopping = False, None, False
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum: int, frame) -> None:
        if self._stopping:
            return
        if self._writing:
            self._pending = signum
            return
        self._stopping = True
        raise Interrupted(signum)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        self._writing = True
        try:
            yield
        finally:
            self._writing = False
        if self._pending is not None:
            self._stopping = True
            raise Interrupted(self._pending)

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


STDIN_NAMES = ("-", "/dev/stdin")  # input paths that mean standard input


def stdin_or_path(path: Path | None) -> Path | None:
    """None (standard input) for ``-`` and ``/dev/stdin``, else the path."""
    return None if path is None or str(path) in STDIN_NAMES else path


def line_progress(input: Path | None, output: Path | None) -> StageProgress:
    """Input lines translated: on a terminal a bar, with a total and ETA when the input is a regular file
    (its lines counted first, a second per GB); none while translations go to the terminal too, as a bar
    redrawn between them would break their lines. Off a terminal, only a line every PLAIN_EVERY_S seconds:
    stderr stays free for warnings."""
    to_terminal = output is None and sys.stdout.isatty()
    total = count_lines(input) if input is not None and not to_terminal and shows_bar() else None
    name = input.name if input is not None else "<stdin>"
    return StageProgress(f"translating {name}", total, "lines", log_ends=False, bar=not to_terminal)


def write_lines(texts: Iterable[str], output: Path | None, whole_lines: WholeLines, progress: StageProgress) -> int:
    """Write each text (one or more whole lines) to ``output``, atomically, or to stdout as each is ready,
    each counted as one line done in ``progress``.

    Returns the count. A signal (``Interrupted``) stops it between texts; with ``output``, the ones
    written so far are then kept in OUTPUT.partial (``stop.partial``), and OUTPUT is not written.
    """
    done = 0
    partial = output.with_name(output.name + ".partial") if output is not None else None

    def write_all(out) -> None:
        nonlocal done
        with progress:
            for text in texts:
                data = text.encode("utf-8")
                with whole_lines.writing():  # counted inside: a signal during the write waits for both
                    out.write(data)
                    if output is None:
                        out.flush()  # a pipeline downstream sees each line as soon as it is done
                    done += 1
                progress.advance()

    try:
        if output is not None:
            atomic_write(output, write_all, partial)
        else:
            write_all(sys.stdout.buffer)
    except Interrupted as stop:
        stop.done, stop.partial = done, partial if done else None
        if partial is not None and not done:
            partial.unlink(missing_ok=True)
        raise
    return done


def translate_file(
    models: list[Path],
    input: Path | None = None,
    output: Path | None = None,
    prefix: Path | None = None,
    nbest: int = 1,
    scores: bool = False,
    alignments: bool = False,
    sampling: SamplingConfig | None = None,
    device: str = InferenceConfig.device,
    precision: InferencePrecision = InferenceConfig.precision,
    engine: Engine = InferenceConfig.engine,
    shortlist: Path | None = None,
    tgt_lang: str | None = None,
    threads: int = InferenceConfig.threads,
    rerank: RerankSettings | None = None,
    src_lang: str | None = None,
    adapter: Path | None = None,
    **decode,
) -> int:
    """Translate ``input`` (a file, a pipe; None, ``-`` or ``/dev/stdin`` for stdin) into ``output``
    (None for stdout), one output line per input line (``nbest`` lines with ``nbest`` > 1); the count.
    ``shortlist``: a file `mtkit shortlist` wrote, which limits each batch's outputs to its candidates;
    ``tgt_lang``: the target language, which a model of several needs (``src_lang`` the source language, which a
    model told its languages by tokens needs); ``adapter``: a LoRA adapter of the model; ``threads``: the CPU
    threads to use;
    ``rerank``: each line's translation chosen among ``rerank.candidates`` (mtkit.translation.reranking), the beam
    that wide unless ``decode`` gives a wider one.

    Everything is checked before the model loads: the input files exist, the output may be written
    (``check_output_file``), stdin and stdout are open. ``decode`` overrides the model's settings.
    A signal stops it between lines with ``Interrupted`` (see ``write_lines``).
    """
    prefix_on_stdin = prefix is not None and stdin_or_path(prefix) is None
    input = stdin_or_path(input)
    if prefix_on_stdin and input is None:
        raise ConfigError("--prefix and the input cannot both be standard input; give one of them as a file")
    asked = {
        "sampling": sampling is not None,
        "prefix": prefix is not None,
        "alignments": alignments,
        "no_early_stop": not decode.get("early_stop", True),
        "ensemble": len(models) > 1,
        "shortlist": shortlist is not None,
        "adapter": adapter is not None,
    }
    if unsupported := refused_options(engine, asked):
        flags = ", ".join(REFUSED_OPTIONS[engine][option] for option in unsupported)
        raise ConfigError(f"--engine {engine} takes one model and no {flags}")
    if engine == "ctranslate2":
        require("ctranslate2", "--engine ctranslate2", "ctranslate2")
    if shortlist is not None and sampling is not None:
        raise ConfigError("--shortlist is for beam search; --sample draws from the whole vocabulary")
    if rerank is not None:
        if nbest > 1 or alignments:
            raise ConfigError("--rerank prints the one translation it chooses: no --nbest, no --alignments")
        rerank.check(sampling is not None, decode.get("beam"))
        nbest = rerank.candidates
        if sampling is None:
            decode.setdefault("beam", rerank.candidates)
    for path in (input, None if prefix_on_stdin else prefix, shortlist):
        if path is not None:
            check_input_file(path, stream_ok=True)
    if output is None and sys.stdout is None:  # started with stdout closed (>&-)
        raise DataError("<stdout>: standard output is closed; give a file to write with -o")
    if output is not None:
        reverse = rerank.reverse_model if rerank is not None else None
        inputs = with_model_files(p for p in (input, prefix, *models, reverse, adapter) if p is not None)
        check_output_file(output, inputs, checkpoints_holding(output))
    with WholeLines() as whole_lines:
        translator = load_translator(
            models, device, precision, engine, nbest, sampling, alignments, shortlist, tgt_lang, threads,
            src_lang=src_lang, adapter=adapter, **decode,
        )  # fmt: skip
        translator.check_target()
        size = line_translator.CHUNK_LINES
        chunks = input_chunks(input, size)
        prefixes = None
        if prefix is not None:
            path = None if prefix_on_stdin else prefix
            prefixes = (line for chunk in input_chunks(path, size) for line in chunk)
        if rerank is not None:
            reranker = load_reranker(rerank, translator, device, precision, engine, threads)
            results = reranked(translator, reranker, chunks, prefixes)
            nbest = 1
        elif prefixes is None:
            results = translator.stream(chunks)
        else:
            results = translator.stream(chunks, prefixes)
        texts = (format_translations(i, t, nbest, scores, alignments) for i, t in enumerate(results))
        try:
            return write_lines(texts, output, whole_lines, line_progress(input, output))
        except PrefixMismatch as err:
            raise DataError(f"{prefix}: {err}") from None
