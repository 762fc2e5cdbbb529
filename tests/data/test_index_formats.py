"""Sheets as people save them: a CSV from Excel in a European locale (';', a byte-order mark,
CRLF) or with tabs, a workbook whose rows are on its second worksheet, and paths written on
Windows. Each loads as the plain sheet does and says once in the log what was assumed; what
cannot be resolved is one error naming the file and the fix."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import openpyxl
import pandas as pd
import pytest

from audioclf.config import DataConfig
from audioclf.data import index as index_module
from audioclf.data.index import IndexValidationError, load_index

HEADER = ["a_cls", "a_item", "a_id", "path"]
CLASSES = ["bird, small", "cat; wild", "dog"]  # a comma and a semicolon inside cells
posix_only = pytest.mark.skipif(os.sep != "/", reason="backslashes are separators on Windows")


def body(separator: str = "/") -> list[list[str]]:
    """3 classes x 2 items x 2 ids, their paths written with `separator`."""
    rows = []
    for c, cls in enumerate(CLASSES):
        for i in range(2):
            for k in range(2):
                parts = ["wav", f"c{c:02d}", f"c{c:02d}_i{i}", f"{k}.wav"]
                rows.append([cls, f"c{c:02d}_i{i}", f"{len(rows):05d}", separator.join(parts)])
    return rows


def write_csv(path: Path, rows: list[list[str]], delimiter: str = ",", excel: bool = False):
    """`excel`: as Excel's "CSV UTF-8" saves it, with a byte-order mark and CRLF line ends."""
    encoding, line_end = ("utf-8-sig", "\r\n") if excel else ("utf-8", "\n")
    with open(path, "w", newline="", encoding=encoding) as handle:
        csv.writer(handle, delimiter=delimiter, lineterminator=line_end).writerows(rows)
    return path


def write_book(path: Path, sheets: dict[str, list[list[str]]]) -> Path:
    book = openpyxl.Workbook()
    book.remove(book.active)
    for name, rows in sheets.items():
        worksheet = book.create_sheet(name)
        for row in rows:
            worksheet.append(row)
    book.save(path)
    return path


def make_files(root: Path, rows: list[list[str]]) -> None:
    for row in rows:
        path = root / row[3].replace("\\", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")


def load(index: Path, **overrides) -> pd.DataFrame:
    """As the trainer loads it."""
    return load_index(DataConfig(index=str(index), **{"check_files": False, **overrides})).table


@pytest.fixture(params=["calamine", "openpyxl"])
def engine(request, monkeypatch) -> str:
    monkeypatch.setattr(index_module.reader, "_excel_engine", lambda: request.param)
    return request.param


# ---------------------------------------------------------------------------------------------
# CSV: the delimiter found from the first rows, the byte-order mark stripped


@pytest.mark.parametrize(
    "delimiter,named", [(";", "semicolons"), ("\t", "tabs")], ids=["semicolon", "tab"]
)
def test_excel_csv_in_another_locale_reads_as_the_comma_csv(tmp_path, notes, delimiter, named):
    plain = load(write_csv(tmp_path / "plain.csv", [HEADER, *body()]))
    sheet = write_csv(tmp_path / "excel.csv", [HEADER, *body()], delimiter, excel=True)
    assert sheet.read_bytes()[:3] == b"\xef\xbb\xbf" and b"\r\n" in sheet.read_bytes()
    table = load(sheet)
    pd.testing.assert_frame_equal(table, plain)
    assert table["cls"].unique().tolist() == CLASSES
    assert table["id"].tolist()[:3] == ["00000", "00001", "00002"]
    assert table["path"].iloc[0] == str(tmp_path / "wav/c00/c00_i0/0.wav")
    assert notes == [f"index file {sheet}: columns separated by {named} (found in the first rows)"]


def test_semicolon_csv_with_a_title_row_finds_its_header(tmp_path, notes):
    title = [["Recordings, spring 2026; field trip"], []]
    sheet = write_csv(tmp_path / "titled.csv", [*title, HEADER, *body()], ";", excel=True)
    table = load(sheet)
    assert table["row"].tolist()[:2] == [4, 5] and len(table) == 12
    assert table["cls"].iloc[4] == "cat; wild"
    assert len(notes) == 1 and "separated by semicolons" in notes[0]
    assert "the header is row 3" in notes[0]


def test_comma_csv_with_bom_and_crlf_logs_nothing(tmp_path, notes):
    table = load(write_csv(tmp_path / "utf8.csv", [HEADER, *body()], ",", excel=True))
    assert table["cls"].iloc[0] == "bird, small" and notes == []


def test_a_csv_resaved_with_another_delimiter_is_not_read_from_the_cache(tmp_path, notes):
    rows = [[cls.replace(";", ","), *rest] for cls, *rest in body()]  # quoted in neither
    sheet = write_csv(tmp_path / "index.csv", [HEADER, *rows], ";")
    first = load(sheet)
    stat = sheet.stat()
    rows = [[*row[:2], "x" + row[2][1:], row[3]] for row in rows]
    write_csv(sheet, [HEADER, *rows], "\t")  # the same size and mtime: only the bytes differ
    os.utime(sheet, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert sheet.stat().st_size == stat.st_size
    again = load(sheet)
    assert first["id"].iloc[0] == "00000" and again["id"].iloc[0] == "x0000"
    assert "semicolons" in notes[0] and "tabs" in notes[1]


# ---------------------------------------------------------------------------------------------
# Workbooks: the one worksheet holding the columns


NOTES_SHEET = [["How to fill in this sheet"], ["one row per clip; a_cls is the class"]]


def test_rows_on_the_second_worksheet_are_found(tmp_path, notes, engine):
    sheet = write_book(tmp_path / "book.xlsx", {"Notes": NOTES_SHEET, "Clips": [HEADER, *body()]})
    table = load(sheet)
    assert table["cls"].unique().tolist() == CLASSES and len(table) == 12
    assert table["id"].iloc[-1] == "00011" and table["row"].iloc[0] == 2
    assert table["path"].iloc[0] == str(tmp_path / "wav/c00/c00_i0/0.wav")
    assert notes == [
        f"index file {sheet}: worksheet 'Clips' read, the one holding 'a_cls', 'a_item', "
        "'a_id' (worksheet 'Notes', data.sheet=0, does not; data.sheet='Clips' says so outright)"
    ]


def test_two_worksheets_with_the_columns_is_an_error_naming_both(tmp_path, engine):
    sheets = {"Notes": NOTES_SHEET, "Train": [HEADER, *body()], "Old": [HEADER, *body()]}
    sheet = write_book(tmp_path / "two.xlsx", sheets)
    pattern = (
        r"two\.xlsx: worksheet 'Notes' \(data\.sheet=0\) does not hold 'a_cls', 'a_item', "
        r"'a_id', and worksheets 'Train', 'Old' both do; set data\.sheet=NAME to the one to "
        r"read, e\.g\. data\.sheet='Train'"
    )
    with pytest.raises(IndexValidationError, match=pattern):
        load(sheet)
    assert load(sheet, sheet="Old")["cls"].iloc[0] == "bird, small"


def test_no_worksheet_with_the_columns_is_todays_error(tmp_path, engine):
    sheet = write_book(tmp_path / "none.xlsx", {"Notes": NOTES_SHEET, "More": [["x", "y"]]})
    with pytest.raises(
        IndexValidationError,
        match=r"none\.xlsx has no column 'a_cls' \(data\.class_column\), 'a_item'.*"
        r"columns present: 'How to fill in this sheet'",
    ):
        load(sheet)


# ---------------------------------------------------------------------------------------------
# Paths written on Windows


@posix_only
def test_windows_separators_resolve_when_the_column_uses_only_them(tmp_path, notes):
    rows = body("\\")
    make_files(tmp_path, rows)
    sheet = write_csv(tmp_path / "win.csv", [HEADER, *rows])
    for _ in range(2):  # parsed, then from the cache
        table = load(sheet, check_files=True)
        assert table["path"].tolist() == [str(tmp_path / r[3]) for r in body()]
        assert all(Path(p).is_file() for p in table["path"])
    assert (
        notes
        == [
            f"index file {sheet}: paths written with Windows separators, read with '/' "
            r"(e.g. wav\c00\c00_i0\0.wav as wav/c00/c00_i0/0.wav)"
        ]
        * 2
    )


@posix_only
def test_drive_letter_paths_are_one_error_with_a_hint(tmp_path):
    rows = [[*row[:3], "C:\\data\\" + row[3]] for row in body("\\")]
    sheet = write_csv(tmp_path / "drive.csv", [HEADER, *rows])
    pattern = (
        r"drive\.csv: 12 of 12 referenced files do not exist: row 2: .*C:\\data\\wav.*"
        r"name a Windows drive or share \(row 2: C:\\data\\wav\\c00\\c00_i0\\0\.wav\), which "
        r"cannot be resolved here: write them relative to data\.root"
    )
    with pytest.raises(IndexValidationError, match=pattern):
        load(sheet, check_files=True)


@posix_only
def test_mixed_separators_are_not_converted_and_the_error_says_so(tmp_path):
    rows = body("\\")
    rows[0][3] = rows[0][3].replace("\\", "/")  # one row written with '/': no conversion
    make_files(tmp_path, rows)
    sheet = write_csv(tmp_path / "mixed.csv", [HEADER, *rows])
    pattern = (
        r"11 of 12 referenced files do not exist: row 3: .*wav\\c00\\c00_i0\\1\.wav.* "
        r"11 paths hold Windows separators \('\\'\) mixed with '/'.*write every path with '/'"
    )
    with pytest.raises(IndexValidationError, match=pattern):
        load(sheet, check_files=True)


@pytest.mark.slow  # three short trainings
@pytest.mark.parametrize("form", ["european csv", "second worksheet", "windows paths"])
def test_the_sheets_as_people_save_them_train(tmp_path, tiny_demo, form):
    from tests.helpers import fit, tiny_config

    table = pd.read_excel(tiny_demo, dtype=str, engine="openpyxl")
    table["path"] = [str(tiny_demo.parent / p) for p in table["path"]]
    if form == "european csv":
        sheet = tmp_path / "index.csv"
        write_csv(sheet, [list(table.columns), *table.values.tolist()], delimiter=";", excel=True)
    elif form == "second worksheet":
        sheet = tmp_path / "index.xlsx"
        with pd.ExcelWriter(sheet, engine="openpyxl") as writer:
            pd.DataFrame({"How to fill in this sheet": ["one row per clip"]}).to_excel(
                writer, sheet_name="Notes", index=False
            )
            table.to_excel(writer, sheet_name="Clips", index=False)
    else:
        sheet = tmp_path / "windows.csv"
        relative = pd.read_excel(tiny_demo, dtype=str, engine="openpyxl")
        relative.assign(path=relative["path"].str.replace("/", "\\")).to_csv(sheet, index=False)
    root = [f"data.root={tiny_demo.parent}"] if form == "windows paths" else []
    summary = fit(
        tiny_config(
            sheet, tmp_path / "runs", "cnn", "train.epochs=1", "train.limit_batches=3", *root
        )
    )
    assert summary["step"] == 3 and summary["metrics"]["precision_at_1"] >= 0
