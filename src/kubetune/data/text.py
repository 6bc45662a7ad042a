"""Text tables (CSV, TSV, JSON, JSON lines): the look at a file's first bytes before it is parsed
(binary data, ZIP/Excel, Parquet or gzip under a text name, byte-order marks, a first line with no
end), the encoding it is read with, and pandas' reading of it whole or a chunk at a time.

With ``data.encoding: auto`` a file is UTF-8, and bytes that are not valid UTF-8 are decoded as
cp1252 byte by byte (the error handler ``FALLBACK_ERRORS``), with a warning that counts them.
"""

from __future__ import annotations

import codecs
import contextlib
import contextvars
import logging
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from kubetune.errors import KubetuneError, short

log = logging.getLogger(__name__)

SNIFF_BYTES = 64 * 1024  # NUL bytes in here: binary data, not text
MAX_FIRST_LINE = 1 << 20  # a CSV header longer than this is not a header
# (magic, what it is, what to do): files that are not text tables, whatever their name says.
MAGIC = [
    (b"PK\x03\x04", "an Excel workbook or ZIP archive", "export it as CSV (or unzip it)"),
    (b"PAR1", "a Parquet file", "rename it to .parquet"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "an old Excel (.xls) or other OLE2 document", "export it as CSV"),
    (b"\x1f\x8b", "gzip-compressed", "decompress it (gunzip)"),
]
# Longest first: the UTF-32 LE mark starts with the UTF-16 LE one.
BOMS = [
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
]
# With data.encoding auto, bytes that are not valid UTF-8 are decoded as cp1252 (latin-1 for the
# five bytes cp1252 leaves undefined), byte by byte, and the valid UTF-8 around them stays UTF-8.
FALLBACK_ERRORS = "kubetune-cp1252-fallback"
# How many times the fallback decoded bytes in the read in progress: each read sets its own counter
# (a context variable, so no counter is shared between reads, threads or tasks).
_FALLBACKS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("kubetune_cp1252", default=None)


def _cp1252_fallback(err: UnicodeError) -> tuple[str, int]:
    if not isinstance(err, UnicodeDecodeError):
        raise err
    used = _FALLBACKS.get()
    if used is not None:
        used[0] += 1
    bad = err.object[err.start : err.end]
    return "".join(bytes([b]).decode("cp1252", errors="ignore") or chr(b) for b in bad), err.end


codecs.register_error(FALLBACK_ERRORS, _cp1252_fallback)


def count_fallbacks() -> list[int]:
    """A fresh counter of the fallback's decodings, made the current read's (``[n]``: read it after the read)."""
    used = [0]
    _FALLBACKS.set(used)
    return used


def codec_name(name: str) -> str:
    try:
        return codecs.lookup(name).name
    except LookupError:
        raise KubetuneError(
            f"unknown encoding {short(name, 40)!r}",
            field="data.encoding",
            fix="use auto, utf-8, latin-1, cp1252, utf-16, ...",
        ) from None


def sniff(path: Path, size: int, fmt: str, encoding: str, uri: str, field: str, in_dir: bool = False) -> str:
    """Look at the first bytes of a text table; return the encoding to read it with.

    Raises KubetuneError for binary data, a ZIP/Excel/Parquet/gzip file under a text name, and a
    CSV/TSV first line with no end; with ``encoding: auto`` a UTF-16/UTF-32 byte-order mark
    selects that encoding (with a warning), a UTF-8 one is dropped.
    """
    explicit = encoding != "auto"
    codec = codec_name(encoding) if explicit else "utf-8"
    with path.open("rb") as f:
        head = f.read(MAX_FIRST_LINE + 1 if fmt in ("csv", "tsv") else SNIFF_BYTES)
    for magic, what, fix in MAGIC:
        if head.startswith(magic):
            raise KubetuneError(f"{short(uri)!r} is {what}, not {fmt}", field=field, fix=fix)
    bom = next((name for mark, name in BOMS if head.startswith(mark)), None)
    if bom in ("utf-16", "utf-32") and not explicit:
        if in_dir:
            raise KubetuneError(
                f"{short(uri)!r} is {bom.upper()} (byte-order mark)",
                field="data.encoding",
                fix=f"set data.encoding: {bom}, or convert the files to UTF-8",
            )
        log.warning(
            "%s: %s byte-order mark; decoded as %s (set data.encoding: %s to silence this)",
            short(uri),
            bom.upper(),
            bom,
            bom,
        )
        return bom
    if b"\x00" in head[:SNIFF_BYTES] and not codec.startswith(("utf-16", "utf-32")):
        fix = (
            f"set data.encoding: {bom} (or auto): the file starts with a {bom.upper()} byte-order mark"
            if bom in ("utf-16", "utf-32")
            else "point it at a text table "
            "(or set data.encoding: utf-16-le / utf-16-be for UTF-16 without a byte-order mark)"
        )
        raise KubetuneError(
            f"{short(uri)!r} holds NUL bytes in its first 64 KiB: binary data, not {fmt} text", field=field, fix=fix
        )
    if (
        fmt in ("csv", "tsv")
        and size > MAX_FIRST_LINE
        and b"\n" not in head[:MAX_FIRST_LINE]
        and b"\r" not in head[:MAX_FIRST_LINE]
    ):
        raise KubetuneError(
            f"{short(uri)!r} has no line break in its first 1 MiB: not a {fmt} table",
            field=field,
            fix=f"check that the file is {fmt} (a header line, then one row per line)",
        )
    if bom == "utf-8-sig" and codec == "utf-8":  # the mark must not become part of the first column name
        return "utf-8-sig"
    return codec if explicit else "utf-8"


def read_text_table(
    path: Path, fmt: str, enc: str, auto: bool, uri: str, field: str, rows: int | None = None
) -> Iterator[pd.DataFrame]:
    """The file's rows, whole (``rows`` None) or ``rows`` at a time."""
    # With auto, only UTF-8 falls back byte by byte; a file with a UTF-16/32 mark is decoded strictly.
    errors = FALLBACK_ERRORS if auto and enc.startswith("utf-8") else "strict"
    used = [0]
    _FALLBACKS.set(used)
    # No NA inference: "None", "NA", "null", "n/a" are labels and texts; only an empty cell is missing.
    csv = {"keep_default_na": False, "na_values": [""], "encoding": enc, "encoding_errors": errors}
    try:
        if fmt in ("csv", "tsv"):
            reader = pd.read_csv(path, sep="\t" if fmt == "tsv" else ",", chunksize=rows, **csv)
        else:
            # dtype=False keeps JSON's own types: the string "123" stays text, "null" stays a string.
            lines = fmt == "jsonl" or _looks_like_jsonl(path, enc)
            reader = pd.read_json(
                path,
                lines=lines,
                encoding=enc,
                encoding_errors=errors,
                dtype=False,
                chunksize=rows if lines else None,
            )
        chunks = iter([reader]) if isinstance(reader, pd.DataFrame) else iter(reader)
        with contextlib.closing(reader) if hasattr(reader, "close") else contextlib.nullcontext():
            while True:
                _FALLBACKS.set(used)  # this read's counter, whatever ran between two chunks
                df = next(chunks, None)
                if df is None:
                    break
                if len(df.columns) and isinstance(df.columns[0], str) and df.columns[0].startswith("\ufeff"):
                    df = df.rename(columns={df.columns[0]: df.columns[0].lstrip("\ufeff")})
                yield df
    except UnicodeError:
        raise KubetuneError(
            f"{short(uri)!r} is not valid {enc}{_where_invalid(path, enc)}",
            field="data.encoding",
            fix="set data.encoding to the file's encoding, e.g. latin-1, cp1252 or utf-16 (or auto)",
        ) from None
    if used[0]:
        n_bytes, n_lines = _invalid_utf8(path)
        log.warning(
            "%s: %d bytes on %d lines are not valid UTF-8; decoded those bytes as cp1252 and the rest as UTF-8 "
            "(set data.encoding to the file's encoding to silence this)",
            short(uri),
            n_bytes,
            n_lines,
        )


def _where_invalid(path: Path, enc: str) -> str:
    """' (byte 0xe9 at offset 1234, line 5)' for the first byte that does not decode; '' if none is found."""
    decoder = codecs.getincrementaldecoder(enc)()
    offset, line = 0, 1
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                at = max(offset, offset + e.start - (len(e.object) - len(chunk)))
                line += chunk[: at - offset].count(b"\n")
                return f" (byte 0x{chunk[at - offset]:02x} at offset {at}, line {line})"
            line += chunk.count(b"\n")
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return f" (truncated at the end, offset {offset})"
    return ""


def _invalid_utf8(path: Path) -> tuple[int, int]:
    """(bytes, lines) of a file that are not valid UTF-8."""
    n_bytes, n_lines = 0, 0
    with path.open("rb") as f:
        for raw in f:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                n_lines += 1
                n_bytes += len(raw) - len(raw.decode("utf-8", errors="ignore").encode("utf-8"))
    return n_bytes, n_lines


def _looks_like_jsonl(path: Path, enc: str) -> bool:
    with path.open("rb") as f:
        head = f.read(256).decode(enc, errors="ignore")
    return not head.lstrip("\ufeff \t\r\n").startswith("[")
