"""What `--data` names: sources (a file, a folder or glob of shards, a `datasets` save_to_disk folder, the embedded
corpus), each with an optional mixture weight, and the rows of each shard read a batch at a time (pyarrow for
parquet, csv and arrow; line by line for jsonl; paragraph chunks for text), so no shard is ever loaded whole."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dstool.corpus import EMBEDDED, read_documents
from dstool.errors import UsageError
from dstool.files import sha256_file, write_json_atomic

SHARD_SUFFIXES = (".txt", ".jsonl", ".parquet", ".csv", ".arrow")
COLUMNS = {"text": ("text",), "chat": ("messages",), "prompt-completion": ("prompt", "completion")}
OPTIONAL = {"chat": ("tools",)}  # read when a shard has them
_BATCH_ROWS = 512
_TEXT_CHUNK = 1 << 20


@dataclass
class Source:
    """One `--data` entry: its shards (files, in a fixed order) and its weight in the mixture (None: unweighted)."""

    spec: str
    shards: list[str]
    weight: float | None = None
    hashes: list[str] = field(default_factory=list)


def parse(data: str | None) -> list[Source]:
    """`--data` as sources: `PATH[:WEIGHT]` entries separated by commas; PATH a file, a folder or a glob."""
    if data is None or data == EMBEDDED:
        return [Source(EMBEDDED, [EMBEDDED])]
    sources = []
    for entry in (e.strip() for e in data.split(",")):
        if not entry:
            raise UsageError(f"--data {data!r} has an empty entry: separate sources with single commas")
        m = re.fullmatch(r"(.+?):([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)", entry)
        path, weight = (m.group(1), float(m.group(2))) if m else (entry, None)
        if weight is not None and not 0 <= weight < float("inf"):
            raise UsageError(f"--data {entry}: a weight must be a finite number, zero or more, not {weight:g}")
        sources.append(Source(path, _shards(path), weight))
    weights = [s.weight for s in sources]
    if any(w is None for w in weights) and any(w is not None for w in weights):
        raise UsageError(f"--data {data}: give every source a weight (PATH:WEIGHT) or none")
    if weights[0] is not None and not sum(w for w in weights if w is not None) > 0:
        raise UsageError(f"--data {data}: the weights sum to zero: give at least one source a positive weight")
    return sources


def _shards(path: str) -> list[str]:
    """The shard files a path names, sorted: a file, a `datasets` folder's arrow files, a folder's shards (recursive)
    or a glob's."""
    p = Path(path)
    if any(c in path for c in "*?[") and not p.exists():
        files = sorted(f for f in glob.glob(path, recursive=True) if Path(f).is_file())
        if not files:
            raise UsageError(f"--data {path}: the pattern matches no file")
    elif not p.exists():
        raise UsageError(f"data path {path} does not exist: pass a file, a folder or glob of shards "
                         f"({', '.join(SHARD_SUFFIXES)}), a `datasets` save_to_disk folder, or omit --data")
    elif p.is_file():
        files = [path]
    elif (p / "dataset_dict.json").is_file():
        splits = _json_field(p / "dataset_dict.json", "splits")
        if "train" not in splits:
            raise UsageError(f"--data {path} is a DatasetDict without a 'train' split ({', '.join(splits)}): name the "
                             f"split's folder, e.g. {p / (splits[0] if splits else 'SPLIT')}")
        return _shards(str(p / "train"))
    elif (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
        files = [str(p / f["filename"]) for f in _json_field(p / "state.json", "_data_files")
                 if isinstance(f, dict) and isinstance(f.get("filename"), str)]
        if not files:
            raise UsageError(f"--data {path}: its state.json names no arrow file: is it a complete `datasets` "
                             "save_to_disk folder?")
    else:
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and _suffix(f) in SHARD_SUFFIXES
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise UsageError(f"data folder {path} holds no shards ({', '.join(SHARD_SUFFIXES)})")
    for f in files:
        if _suffix(Path(f)) not in SHARD_SUFFIXES:
            raise UsageError(f"--data: {f} is not a shard dstool reads ({', '.join(SHARD_SUFFIXES)}, optionally .gz "
                             "for text and jsonl)")
    return files


def _json_field(path: Path, key: str) -> list:
    """A list field of a `datasets` folder's JSON file, or a one-line UsageError."""
    try:
        value = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        value = None
    if not isinstance(value, list):
        raise UsageError(f"{path} is not a `datasets` file with a {key!r} list: is the folder complete?")
    return value


def reader(shard: str) -> str:
    """Which reader a shard goes through (its suffix)."""
    return "embedded" if shard == EMBEDDED else _suffix(Path(shard))


def _suffix(f: Path) -> str:
    suffixes = f.suffixes
    return suffixes[-2] if suffixes[-1:] == [".gz"] and len(suffixes) > 1 else f.suffix


def content_hash(shard: str, stat_cache: dict) -> str:
    """sha256 of a shard's bytes; re-read only when its size, mtime or inode changed (the stat cache, like git's
    index: a shard modified in place gets a new mtime)."""
    if shard == EMBEDDED:
        return "embedded-tinyshakespeare-1"
    st = os.stat(shard)
    key = os.path.abspath(shard)
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    known = stat_cache.get(key)
    if known and known[0] == stamp:
        return known[1]
    digest = sha256_file(Path(shard))
    stat_cache[key] = [stamp, digest]
    return digest


class StatCache:
    """The stat cache of content hashes, kept in a JSON file."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.entries = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.entries)


def rows(shard: str, data_format: str) -> Iterator[list[dict]]:
    """The shard's rows, a batch at a time, as dicts of the format's columns; a one-line UsageError when the shard is
    not what its name says or lacks a column."""
    want = COLUMNS[data_format]
    if shard == EMBEDDED:
        if data_format != "text":
            raise UsageError(f"--data-format {data_format} needs data with {' and '.join(want)}: the embedded corpus "
                             "is plain text (pass --data FILE.jsonl)")
        docs = [{"text": d} for d in read_documents(None)]
        for i in range(0, len(docs), _BATCH_ROWS):
            yield docs[i:i + _BATCH_ROWS]
        return
    suffix = _suffix(Path(shard))
    try:
        if suffix == ".txt":
            if data_format != "text":
                raise UsageError(f"{shard}: a .txt shard is plain text; --data-format {data_format} reads "
                                 f"{' and '.join(want)} from .jsonl, .parquet, .csv or arrow shards")
            yield from _text_chunks(shard)
        elif suffix == ".jsonl":
            yield from _jsonl(shard, want, OPTIONAL.get(data_format, ()))
        else:
            yield from _arrow(shard, suffix, want, OPTIONAL.get(data_format, ()))
    except UsageError:
        raise
    except (OSError, ValueError, UnicodeDecodeError, EOFError, zlib.error) as e:  # pyarrow's: ValueError/OSError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"shard {shard} is not a readable {suffix.lstrip('.')} file ({first[:200]}): fix or remove "
                         "it") from None


def _open(shard: str):
    return gzip.open(shard, "rt", encoding="utf-8") if shard.endswith(".gz") else open(shard, encoding="utf-8")


def _text_chunks(shard: str) -> Iterator[list[dict]]:
    """A .txt shard is one document, read in ~1 MiB pieces cut at paragraph ends (`piece` rows: no EOS between)."""
    buf = ""
    with _open(shard) as f:
        while block := f.read(_TEXT_CHUNK):
            buf += block
            cut = buf.rfind("\n\n", len(buf) - len(block) - 1)
            if cut < 0 and len(buf) > 4 * _TEXT_CHUNK:  # no paragraph end for a while: cut at a line or a space
                cut = max(buf.rfind("\n"), buf.rfind(" "), len(buf) - 3)
            if cut > 0:
                yield [{"text": buf[:cut + 2], "piece": True}]
                buf = buf[cut + 2:]
    if buf.strip():
        yield [{"text": buf, "piece": True}]
    yield [{"text": "", "piece": False}]  # the document ends: the tokenizer adds its EOS here


def _jsonl(shard: str, want: tuple[str, ...], optional: tuple[str, ...]) -> Iterator[list[dict]]:
    batch: list[dict] = []
    with _open(shard) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                raise UsageError(f"{shard}:{n} is not a JSON object (a .jsonl shard holds one per line)") from None
            if not isinstance(row, dict) or any(c not in row for c in want):
                got = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
                raise UsageError(f"{shard}:{n} has no {' and '.join(repr(c) for c in want)} field (it has: {got}): "
                                 f"every row needs it, or choose --data-format")
            batch.append({c: row[c] for c in want + optional if c in row})
            if len(batch) == _BATCH_ROWS:
                yield batch
                batch = []
    if batch:
        yield batch


def _arrow(shard: str, suffix: str, want: tuple[str, ...], optional: tuple[str, ...]) -> Iterator[list[dict]]:
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    if suffix == ".parquet":
        pf = pq.ParquetFile(shard)
        names = pf.schema_arrow.names
        _has_columns(shard, names, want)
        batches = pf.iter_batches(batch_size=_BATCH_ROWS, columns=[*want, *(c for c in optional if c in names)])
    elif suffix == ".csv":
        reader = pa_csv.open_csv(shard, read_options=pa_csv.ReadOptions(block_size=1 << 22),  # text, not inferred
                                 convert_options=pa_csv.ConvertOptions(column_types={c: pa.string() for c in want}))
        _has_columns(shard, reader.schema.names, want)
        batches = reader
    else:  # a `datasets` arrow file (IPC stream), memory-mapped
        source = pa.memory_map(shard)
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)  # the IPC file format
            batches_ = (reader.get_batch(i) for i in range(reader.num_record_batches))
            _has_columns(shard, reader.schema.names, want)
            batches = batches_
        else:
            _has_columns(shard, reader.schema.names, want)
            batches = reader
    for batch in batches:
        read = want + tuple(c for c in optional if c in batch.schema.names)
        for start in range(0, batch.num_rows, _BATCH_ROWS):  # a huge record batch is read a slice at a time
            part = batch.slice(start, _BATCH_ROWS)
            columns = {c: part.column(part.schema.get_field_index(c)).to_pylist() for c in read}
            yield [{c: columns[c][i] for c in read} for i in range(part.num_rows)]


def _has_columns(shard: str, names: list[str], want: tuple[str, ...]) -> None:
    missing = [c for c in want if c not in names]
    if missing:
        raise UsageError(f"shard {shard} has no {' and '.join(repr(c) for c in missing)} column (it has: "
                         f"{', '.join(names) or 'none'}): every shard needs it, or choose --data-format")
