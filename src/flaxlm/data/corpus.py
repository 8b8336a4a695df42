"""Load the text corpus named by a `LanguageConfig` and split it into train and validation.

Three sources, all ending as a table with one column, "text": flaxlm's own `Texts` for the
builtin corpus, plain-text and JSON Lines files (no `datasets` imported, seconds saved at every
start), a `datasets.Dataset` for the rest:

* `builtin`: the interpreter's own documentation (pydoc topics and the docstrings of the pure-Python
  standard library), so that every machine with Python can train something offline;
* `files`: .txt / .jsonl / .json / .parquet / .csv files, given as paths or glob patterns, local
  or in a bucket (s3://, gs://);
* `hub`: `datasets.load_dataset` on a Hugging Face Hub dataset (or a local directory of data files).

Blank documents are dropped, then validation is the FIRST
`validation_fraction` of the documents and train the rest; the optional caps keep the first N of
each. Every problem the user can fix is raised as a `FlaxlmError` naming the setting or file.
"""

from __future__ import annotations

import ast
import codecs
import dataclasses
import functools
import gc
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

import numpy as np

from flaxlm.config import CorpusSource, LanguageConfig, TextSplitting
from flaxlm.data.datasets_cache import keep_datasets_cache_under
from flaxlm.data.files import check_file_type, expand_patterns, quiet_datasets_logs, root_cause
from flaxlm.data.tables import text_dataset
from flaxlm.data.texts import Texts, concatenate, read_json_lines
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module

datasets = lazy_module("datasets")
pc = lazy_module("pyarrow.compute")

# Standard-library directories whose docstrings are not prose about Python (tests, GUI, vendored
# tools) or are already in the corpus (pydoc_data holds the topics).
_SKIPPED_STDLIB_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "__pycache__",
        "pydoc_data",
    }
)
_MIN_BUILTIN_DOC_CHARS = 200  # shorter ones are one-liners ("Codec for cp1252"), not prose

_PARAGRAPH_BREAK = re.compile(r"\n(?:[^\S\n]*\n)+")  # blank lines may hold spaces or tabs

# File extension -> `datasets` packaged builder; None: plain text, read and split here.
_BUILDERS = {".txt": None, ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_FORMAT_HINTS = {
    "json": "JSON Lines (one object per line) or a JSON array of objects",
    "parquet": "Parquet",
    "csv": "CSV with a header row",
}


@dataclasses.dataclass(frozen=True)
class CorpusSplits:
    """Train and validation documents: each a table (`Texts` or a Dataset) with one non-blank
    str column, "text"."""

    train: datasets.Dataset | Texts
    validation: datasets.Dataset | Texts


def load_corpus(language: LanguageConfig, cache_dir: str | None = None) -> CorpusSplits:
    """Load the corpus `language` names, drop blank documents, and split it (the builtin
    corpus, copies of files in a bucket, and what `datasets` builds, are kept under
    `cache_dir`)."""
    _check_split_settings(language)
    keep_datasets_cache_under(cache_dir)
    if language.source == CorpusSource.builtin:
        corpus = Texts(builtin_documents(cache_dir))
        origin = "the builtin corpus (language.source=builtin)"
    elif language.source == CorpusSource.files:
        corpus = _load_files(language, cache_dir)
        origin = f"language.files={list(language.files)}"
    elif language.source == CorpusSource.hub:
        corpus = _load_hub(language)
        origin = f"language.hub_path={language.hub_path!r}"
    else:
        raise FlaxlmError(
            f"Unknown language.source={language.source!r}; use builtin, files or hub."
        )
    return _split(_drop_blank(corpus), language, origin)


def read_without_datasets(language: LanguageConfig) -> bool:
    """Whether `load_corpus` reads `language` itself (`Texts`), without `datasets`: the
    builtin corpus, and files that are all plain text or JSON Lines, not streamed."""
    if language.streaming:
        return False
    if language.source == CorpusSource.builtin:
        return True
    return language.source == CorpusSource.files and all(
        pattern.lower().endswith((".txt", ".jsonl")) for pattern in language.files)


def builtin_documents(cache_dir: str | None = None) -> list[str]:
    """The builtin English corpus: Python's own documentation, in a fixed pseudo-random order.

    Parsing the standard library takes seconds; with `cache_dir` the documents are kept in
    `<cache_dir>/builtin/`, keyed by the interpreter and every source file's size and time,
    so a changed standard library is read again."""
    return list(_builtin_documents(None if cache_dir is None else os.path.expanduser(cache_dir)))


# --- builtin -------------------------------------------------------------------------------------


@functools.cache
def _builtin_documents(cache_dir: str | None) -> tuple[str, ...]:
    sources = tuple(_stdlib_sources())
    if cache_dir is None:
        return _parse_builtin(sources)
    path = os.path.join(cache_dir, "builtin", _builtin_key(sources) + ".json")
    try:
        with open(path, encoding="utf-8") as file:
            return tuple(json.load(file))
    except (OSError, ValueError):  # not kept yet, or a copy cut short: read it again
        pass
    documents = _parse_builtin(sources)
    _write_atomically(path, json.dumps(documents))
    return documents


@functools.cache  # once per process, whichever cache directories its jobs use
def _parse_builtin(sources: tuple[tuple[str, Path], ...]) -> tuple[str, ...]:
    topics = _pydoc_topics()  # first: a Python without them fails before seconds of parsing
    stdlib = [(title, _docstrings(path)) for title, path in sources]
    titled = [(t, doc) for t, doc in topics + stdlib if len(doc) >= _MIN_BUILTIN_DOC_CHARS]
    # Shuffle by a hash of the title, so that "the first 5% = validation" samples both pydoc
    # topics and module docstrings, identically in every process.
    titled.sort(key=lambda item: hashlib.sha256(item[0].encode()).hexdigest())
    return tuple(doc for _, doc in titled)


def _builtin_key(sources: tuple[tuple[str, Path], ...]) -> str:
    digest = hashlib.sha256(json.dumps(
        [1, sys.version, _MIN_BUILTIN_DOC_CHARS, sorted(_SKIPPED_STDLIB_DIRS)]).encode())
    for title, path in sources:
        stat = path.stat()
        digest.update(f"{title}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def _write_atomically(path: str, text: str) -> None:
    """Whole or not at all, and processes writing the same file at once each leave it whole.
    A cache that cannot be written is no error: the corpus is read again next time."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), suffix=".tmp",
                                         delete=False, encoding="utf-8") as file:
            file.write(text)
        os.replace(file.name, path)
    except OSError:
        pass


def _pydoc_topics() -> list[tuple[str, str]]:
    try:
        from pydoc_data.topics import topics
    except ImportError as err:
        raise FlaxlmError(
            "The builtin corpus (language.source=builtin) needs the standard library's "
            "`pydoc_data` package, which this Python installation lacks (some Linux distributions "
            "strip it). Install the full Python documentation package, or train on your own text "
            "with language.source=files and language.files=[path/to/*.txt]."
        ) from err
    return [(f"topic:{name}", text) for name, text in sorted(topics.items())]


def _stdlib_sources() -> list[tuple[str, Path]]:
    """(title, path) of every pure-Python stdlib module, whose docstrings are read without
    importing it."""
    root = Path(sysconfig.get_paths()["stdlib"])
    modules = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_STDLIB_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                path = Path(directory, name)
                modules.append((f"module:{path.relative_to(root).as_posix()}", path))
    return modules


def _parse(source: bytes, filename: str) -> ast.Module:
    """`ast.parse` with the garbage collector paused. CPython 3.11 (3.11.7 here) counts the
    recursion of turning a parse into Python objects in state that every parse of the process
    shares: a collection in the middle can run a finalizer that parses or compiles too, and the
    outer parse then fails with "SystemError: AST constructor recursion depth mismatch" (seen
    once in the test suite). Paused, no finalizer runs in between; a parse that meets it all the
    same (another thread parsing at that moment) is parsed again."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # old modules have invalid escape sequences
            try:
                return ast.parse(source, filename=filename)
            except SystemError as err:
                if "recursion depth mismatch" not in str(err):
                    raise
                return ast.parse(source, filename=filename)
    finally:
        if collecting:
            gc.enable()


def _docstrings(path: Path) -> str:
    """The module, class and function docstrings of a source file, in source order."""
    try:
        tree = _parse(path.read_bytes(), str(path))
    except (OSError, SyntaxError, ValueError):
        return ""
    definitions = [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    definitions.sort(key=lambda n: (n.lineno, n.col_offset))
    docs = (ast.get_docstring(node, clean=True) for node in [tree, *definitions])
    return "\n\n".join(doc for doc in docs if doc)


# --- files ---------------------------------------------------------------------------------------


def _load_files(language: LanguageConfig, cache_dir: str | None) -> datasets.Dataset | Texts:
    paths = _expand(language.files, cache_dir)
    for path in paths:
        _check_file(path)
    parts = [_load_file(path, language) for path in paths]
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(part, Texts) for part in parts):
        return concatenate(parts)
    return datasets.concatenate_datasets(
        [part.as_dataset() if isinstance(part, Texts) else part for part in parts])


def _expand(patterns: list[str], cache_dir: str | None) -> list[Path]:
    if not patterns:
        raise FlaxlmError(
            "language.source=files but language.files is empty: give one or more paths or glob "
            "patterns, e.g. language.files=[data/*.txt]."
        )
    return expand_patterns(patterns, "language.files", cache_dir)


def _check_file(path: Path) -> None:
    """Fail on what `datasets` would report badly or not at all: wrong type, empty, bad UTF-8."""
    check_file_type(path, "language.files", _BUILDERS)
    if path.suffix.lower() != ".parquet":
        _check_utf8(path)


def _check_utf8(path: Path) -> None:
    # pyarrow's JSON reader accepts invalid UTF-8 and fails only when the text is read, so check
    # every text file ourselves, in chunks so that a large file need not fit in memory.
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file before `chunk`
    with open(path, "rb") as file:
        while True:
            chunk = file.read(1 << 24)
            pending = len(decoder.getstate()[0])  # bytes of a character split across chunks
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                raise FlaxlmError(
                    f"language.files: {str(path)!r} is not valid UTF-8 (byte offset "
                    f"{offset - pending + err.start}: {err.reason}). Re-encode it as UTF-8, e.g. "
                    f"`iconv -f latin1 -t utf-8`."
                ) from None
            if not chunk:
                return
            offset += len(chunk)


def _load_file(path: Path, language: LanguageConfig) -> datasets.Dataset | Texts:
    builder = _BUILDERS[path.suffix.lower()]
    if builder is None:
        documents = _split_text(path.read_text(encoding="utf-8"), language.text_splitting)
        table = Texts(documents)
    elif path.suffix.lower() == ".jsonl":  # read here: `datasets` would cost seconds to import
        table = read_json_lines(path, language.text_column, "language.files")
        _check_some_text(table.documents.count(None), len(table), language.text_column,
                         repr(str(path)))
    else:
        try:
            with quiet_datasets_logs():
                table = datasets.load_dataset(builder, data_files=[str(path)], split="train")
        except Exception as err:  # datasets raises anything from StopIteration to ArrowInvalid
            raise FlaxlmError(
                f"language.files: could not parse {str(path)!r} as {path.suffix[1:]} "
                f"({root_cause(err)}). Check that the file is well-formed "
                f"{_FORMAT_HINTS[builder]}, or remove it from language.files."
            ) from err
        table = _text_column(table, language.text_column, where=repr(str(path)))
    table = _drop_blank(table, source=None if builder is None else
                        f"language.text_column={language.text_column!r} of {str(path)!r}")
    if len(table) == 0:
        raise FlaxlmError(
            f"language.files: {str(path)!r} holds no non-blank text"
            f"{'' if builder is None else f' in column {language.text_column!r}'}. "
            "Remove it from language.files or fill it."
        )
    return table


def _split_text(text: str, splitting: TextSplitting) -> list[str]:
    """Cut a plain-text file into documents (blank ones are dropped later)."""
    if splitting == TextSplitting.document:
        return [text]
    if splitting == TextSplitting.paragraph:
        # read_text has already turned \r\n into \n
        return [block.strip("\n") for block in _PARAGRAPH_BREAK.split(text)]
    if splitting == TextSplitting.line:
        return text.splitlines()
    raise FlaxlmError(
        f"Unknown language.text_splitting={splitting!r}; use document, paragraph or line."
    )


# --- hub -----------------------------------------------------------------------------------------


def _load_hub(language: LanguageConfig) -> datasets.Dataset:
    where = f"language.hub_path={language.hub_path!r}"
    table = _text_column(_open_hub(language, streaming=False), language.text_column, where)
    return _drop_blank(table, source=f"language.text_column={language.text_column!r} of {where}")


def _open_hub(language: LanguageConfig, streaming: bool):
    """`datasets.load_dataset` on the hub dataset (or local directory) `language` names, as a
    Dataset or, streaming, an IterableDataset; every failure as one FlaxlmError."""
    if not language.hub_path:
        raise FlaxlmError(
            "language.source=hub but language.hub_path is not set: name a Hub dataset, e.g. "
            "language.hub_path=roneneldan/TinyStories, or a local directory of data files."
        )
    try:
        return datasets.load_dataset(
            language.hub_path,
            language.hub_config,
            split=language.hub_split,
            revision=language.hub_revision,
            streaming=streaming,
        )
    except Exception as err:  # not found, offline, gated, unknown config or split, bad files
        raise FlaxlmError(
            f"Could not {'stream' if streaming else 'load'} "
            f"language.hub_path={language.hub_path!r} "
            f"(language.hub_config={language.hub_config!r}, language.hub_split="
            f"{language.hub_split!r}, language.hub_revision={language.hub_revision!r}): "
            f"{root_cause(err)}. Check the names on the Hub, that this machine has network "
            "access (or, with HF_HUB_OFFLINE=1, that the dataset is in the local cache), and, for "
            "a gated corpus, that you accepted its terms and set HF_TOKEN."
        ) from err


# --- common --------------------------------------------------------------------------------------


def _text_column(table: datasets.Dataset, column: str, where: str) -> datasets.Dataset:
    """Keep only `column`, renamed "text", as plain strings."""
    if column not in table.column_names:
        raise FlaxlmError(
            f"language.text_column={column!r} is not a column of {where}; its columns are "
            f"{table.column_names}. Set language.text_column to the one that holds the text."
        )
    missing = table.with_format("arrow")[column].null_count  # a row without the field: null
    _check_some_text(missing, len(table), column, where)
    feature = table.features[column]
    if not isinstance(feature, datasets.Value) or feature.dtype not in ("string", "large_string"):
        raise FlaxlmError(
            f"language.text_column={column!r} of {where} holds {feature}, not text. Set "
            "language.text_column to a column of strings."
        )
    table = table.select_columns([column])
    if column != "text":
        table = table.rename_column(column, "text")
    # pandas writes large_string; one type lets files of different origins be concatenated
    return (
        table.cast_column("text", datasets.Value("string")) if feature.dtype != "string" else table
    )


def _check_some_text(missing: int, rows: int, column: str, where: str) -> None:
    if missing and missing == rows:
        raise FlaxlmError(
            f"language.text_column={column!r} is missing or null in every one of the "
            f"{rows} rows of {where}. Set language.text_column to the field that holds the "
            "text, or fix the data."
        )


def _warn(message: str) -> None:
    """One line on stderr about input that is used, but not all of it."""
    print(f"flaxlm: warning: {message}", file=sys.stderr, flush=True)


def _drop_blank(table: datasets.Dataset | Texts,
                source: str | None = None) -> datasets.Dataset | Texts:
    """The documents that are neither null nor blank. Rows of a structured `source` (its text
    column, named) whose text is null, i.e. missing, are counted in a one-line warning: unlike
    blank text, that is a surprise in the data. If no document is left, the caller says so."""
    if isinstance(table, Texts):
        kept = [text for text in table.documents if text is not None and text.strip()]
        if len(kept) == len(table):
            return table
        nulls = table.documents.count(None)
        if source is not None and nulls and kept:
            _warn_missing(source, nulls, len(table))
        return Texts(kept)
    text = table.with_format("arrow")["text"]
    keep = pc.fill_null(pc.not_equal(pc.utf8_trim_whitespace(text), ""), False)
    if pc.all(keep).as_py():
        return table  # the usual case; select() would add an index mapping for nothing
    kept = np.flatnonzero(keep.to_numpy(zero_copy_only=False))
    if source is not None and text.null_count and kept.size:
        _warn_missing(source, text.null_count, len(table))
    return table.select(kept)


def _warn_missing(source: str, nulls: int, rows: int) -> None:
    _warn(f"{source} is missing or null in {nulls} of the {rows} rows ({nulls / rows:.0%}); "
          "those rows are skipped.")


def _check_split_settings(language: LanguageConfig) -> None:
    if not 0 < language.validation_fraction < 1:
        raise FlaxlmError(
            f"language.validation_fraction={language.validation_fraction} must lie strictly "
            "between 0 and 1 (0.05 keeps the first 5% of the documents for validation)."
        )
    for name in ("max_train_docs", "max_eval_docs"):
        cap = getattr(language, name)
        if cap is not None and cap < 1:
            raise FlaxlmError(f"language.{name}={cap} must be at least 1, or null for no cap.")


def _split(corpus: datasets.Dataset | Texts, language: LanguageConfig, origin: str) -> CorpusSplits:
    n = len(corpus)
    if n < 2:
        raise FlaxlmError(
            f"{origin} yields {n} non-blank document(s); at least 2 are needed to split it into "
            "train and validation. Add text, or choose a finer language.text_splitting "
            "(paragraph or line) for plain-text files."
        )
    # The epsilon keeps float noise (0.07 * 100 = 7.000000000000001) from adding a document.
    n_validation = max(1, math.ceil(language.validation_fraction * n - 1e-9))
    if n_validation >= n:
        raise FlaxlmError(
            f"language.validation_fraction={language.validation_fraction} of the {n} documents "
            f"from {origin} leaves no training documents. Lower language.validation_fraction or "
            "add text."
        )
    train, validation = corpus.select(range(n_validation, n)), corpus.select(range(n_validation))
    if language.max_train_docs is not None:
        train = train.select(range(min(language.max_train_docs, len(train))))
    if language.max_eval_docs is not None:
        validation = validation.select(range(min(language.max_eval_docs, len(validation))))
    return CorpusSplits(train=train, validation=validation)


# --- streaming -----------------------------------------------------------------------------------

STREAMING_EVAL_DOCS = 1000  # language.max_eval_docs when streaming and null


def load_corpus_stream(
    language: LanguageConfig, cache_dir: str | None = None
) -> tuple[datasets.Dataset, datasets.IterableDataset]:
    """(validation, train) for language.streaming: validation is the first `max_eval_docs`
    non-blank documents of the stream, materialised (small); train is the rest of the stream,
    never materialised. Train skips the validation head, so no document is in both. Files in
    a bucket are streamed from their copies in `cache_dir`, where `datasets` keeps its own
    files too."""
    _check_split_settings(language)
    keep_datasets_cache_under(cache_dir)
    stream = _drop_blank_stream(_open_stream(language, cache_dir))
    n_validation = language.max_eval_docs or STREAMING_EVAL_DOCS
    validation = text_dataset([row["text"] for row in stream.take(n_validation)])
    if len(validation) < n_validation:
        raise FlaxlmError(
            f"{_stream_origin(language)} streams only {len(validation)} non-blank document(s), "
            f"all taken for validation (language.max_eval_docs={n_validation}), leaving none "
            "for training. Lower language.max_eval_docs or add text."
        )
    train = stream.skip(n_validation)
    if language.max_train_docs is not None:
        train = train.take(language.max_train_docs)
    return validation, train


def _open_stream(language: LanguageConfig, cache_dir: str | None) -> datasets.IterableDataset:
    if language.source == CorpusSource.files:
        return _stream_files(language, cache_dir)
    if language.source == CorpusSource.hub:
        return _stream_hub(language)
    if language.source == CorpusSource.builtin:  # small and in memory anyway: stream it as well
        return text_dataset(builtin_documents()).to_iterable_dataset()
    raise FlaxlmError(f"Unknown language.source={language.source!r}; use builtin, files or hub.")


def _stream_origin(language: LanguageConfig) -> str:
    if language.source == CorpusSource.files:
        return f"language.files={list(language.files)}"
    if language.source == CorpusSource.hub:
        return f"language.hub_path={language.hub_path!r}"
    return "the builtin corpus (language.source=builtin)"


def _stream_hub(language: LanguageConfig) -> datasets.IterableDataset:
    return _stream_text_column(
        _open_hub(language, streaming=True), language.text_column,
        where=f"language.hub_path={language.hub_path!r}",
    )


def _stream_files(language: LanguageConfig, cache_dir: str | None) -> datasets.IterableDataset:
    """One stream over the files in language.files order; each file is one shard."""
    paths = _expand(language.files, cache_dir)
    for path in paths:
        # The UTF-8 scan of _check_file would read every file once more before training.
        if path.suffix.lower() not in _BUILDERS or path.stat().st_size == 0:
            _check_file(path)
    return datasets.IterableDataset.from_generator(
        _file_documents,
        gen_kwargs={
            "paths": [str(p) for p in paths],  # a list: one shard per file
            "column": language.text_column,
            "splitting": language.text_splitting.value,
        },
        features=datasets.Features({"text": datasets.Value("string")}),
    )


def _file_documents(paths: list[str], column: str, splitting: str):
    """Rows {"text"} of each file in turn. Data files are streamed by `datasets`; a plain-text
    file is read whole and split as without streaming (memory: its largest file)."""
    for name in paths:
        path = Path(name)
        builder = _BUILDERS[path.suffix.lower()]
        if builder is None:
            texts = _split_text(path.read_text(encoding="utf-8"), TextSplitting(splitting))
            yield from ({"text": text} for text in texts)
            continue
        rows = datasets.load_dataset(builder, data_files=[name], split="train", streaming=True)
        yield from _stream_text_column(rows, column, where=repr(name))


def _stream_text_column(
    stream: datasets.IterableDataset, column: str, where: str
) -> datasets.IterableDataset:
    """Keep only `column`, renamed "text". A JSON stream knows its columns only once read, so
    the first row is peeked at (one row, not the file)."""
    columns = list(stream.features) if stream.features is not None else None
    if columns is None:
        first = next(iter(stream.take(1)), None)
        columns = list(first) if first is not None else [column]
    if column not in columns:
        raise FlaxlmError(
            f"language.text_column={column!r} is not a column of {where}; its columns are "
            f"{columns}. Set language.text_column to the one that holds the text."
        )
    stream = stream.select_columns([column])
    return stream.rename_column(column, "text") if column != "text" else stream


def _drop_blank_stream(stream: datasets.IterableDataset) -> datasets.IterableDataset:
    # Before the validation head and the process shards are taken, so that both count
    # non-blank documents only, as without streaming.
    return stream.filter(_is_document)


def _is_document(row: dict) -> bool:
    text = row["text"]
    if text is not None and not isinstance(text, str):
        raise FlaxlmError(
            f"The text column of the streamed corpus holds {type(text).__name__} values, not "
            "text. Set language.text_column to a column of strings."
        )
    return bool(text and text.strip())
