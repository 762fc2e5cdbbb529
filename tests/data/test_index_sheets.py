"""Forgiving sheets, still strict on content: column names matched ignoring case and spaces, a
header below title rows found (or named by data.header_row), text cells kept as text, and the
sheet's own row numbers in the table and in every message."""

from __future__ import annotations

import csv
from pathlib import Path

import openpyxl
import pandas as pd
import pytest

from audioclf.config import DataConfig
from audioclf.data import index as index_module
from audioclf.data.index import IndexValidationError, load_index, read_table, split_index
from audioclf.data.index.table import FIRST_DATA_ROW, HEADER_SEARCH_ROWS

HEADER = ["a_cls", "a_item", "a_id", "path"]
MESSY_HEADER = ["A_CLS", " A_Item ", "A_ID", "PATH"]
TITLE = [["Recordings, spring 2026"], []]  # a title row and a blank row above the header
FORMATS = [(".xlsx", "calamine"), (".xlsx", "openpyxl"), (".csv", None)]


def body() -> list[list[str]]:
    """3 classes x 2 items x 2 ids; ids a spreadsheet would turn into numbers or dates."""
    rows = []
    for cls in ("bird", "cat", "dog"):
        for item in range(2):
            for _ in range(2):
                sample_id = f"{len(rows) + 1:05d}" if len(rows) != 3 else "2026-01-02"
                rows.append([cls, f"{cls}_rec{item}", sample_id, f"wav/{sample_id}.wav"])
    return rows


def write_rows(path: Path, rows: list[list[str]]) -> Path:
    """Every cell written as text (as a sheet holding ids typed as text stores them)."""
    if path.suffix == ".xlsx":
        book = openpyxl.Workbook()
        for row in rows:
            book.active.append(row)
        book.save(path)
    else:
        with open(path, "w", newline="", encoding="utf-8") as handle:
            csv.writer(handle).writerows(rows)
    return path


@pytest.fixture(params=FORMATS, ids=["xlsx-calamine", "xlsx-openpyxl", "csv"])
def suffix(request, monkeypatch) -> str:
    suffix, engine = request.param
    if engine:
        monkeypatch.setattr(index_module.reader, "_excel_engine", lambda: engine)
    return suffix


def load(sheet: Path, **overrides) -> pd.DataFrame:
    return load_index(DataConfig(index=str(sheet), check_files=False, **overrides)).table


# ---------------------------------------------------------------------------------------------
# A messy header reads as the plain sheet does


def test_upper_case_header_below_a_title_reads_as_the_plain_sheet(tmp_path, suffix, notes):
    plain_sheet = write_rows(tmp_path / f"plain{suffix}", [HEADER, *body()])
    messy_sheet = write_rows(tmp_path / f"messy{suffix}", [*TITLE, MESSY_HEADER, *body()])
    plain, messy = (
        load_index(DataConfig(index=str(sheet), root=str(tmp_path), check_files=False))
        for sheet in (plain_sheet, messy_sheet)
    )
    shifted = plain.table.assign(row=plain.table["row"] + len(TITLE))  # the sheet's own rows
    pd.testing.assert_frame_equal(messy.table, shifted)
    assert messy.table["row"].tolist()[:2] == [4, 5]  # header on row 3, data from row 4
    assert messy.table["id"].tolist()[:4] == ["00001", "00002", "00003", "2026-01-02"]
    assert notes == [
        f"index file {messy_sheet}: the header is row 3, the first holding 'a_cls', 'a_item', "
        "'a_id' (rows 1-2 above it are not read; data.header_row=3 says so outright); columns "
        "matched ignoring case and spaces: 'A_CLS' as 'a_cls' (data.class_column), 'A_Item' as "
        "'a_item' (data.item_column), 'A_ID' as 'a_id' (data.id_column), 'PATH' as 'path' "
        "(data.path_column)"
    ]
    cfg = DataConfig(val_ratio=0.34, seed=2)
    plain_splits, messy_splits = split_index(plain, cfg), split_index(messy, cfg)
    for name in ("train", "val"):  # the same training and validation sets
        assert messy_splits[name].table["id"].tolist() == plain_splits[name].table["id"].tolist()


def test_plain_sheet_logs_nothing(tmp_path, suffix, notes):
    load(write_rows(tmp_path / f"plain{suffix}", [HEADER, *body()]))
    assert notes == []


def test_assumptions_are_logged_on_a_cache_hit_too(tmp_path, suffix, notes, monkeypatch):
    sheet = write_rows(tmp_path / f"messy{suffix}", [*TITLE, MESSY_HEADER, *body()])
    first = load(sheet)
    monkeypatch.setattr(
        index_module, "read_table", lambda *a: pytest.fail("read_table was called on a cache hit")
    )
    pd.testing.assert_frame_equal(load(sheet), first)
    assert len(notes) == 2 and notes[0] == notes[1]


def test_read_table_rows_line_up_with_the_index_rows(tmp_path, suffix):
    """audioclf.prepare reads rows back by number: position + FIRST_DATA_ROW is the sheet row."""
    sheet = write_rows(tmp_path / f"messy{suffix}", [*TITLE, MESSY_HEADER, *body()])
    table = load(sheet)
    raw = read_table(sheet, DataConfig())
    assert list(raw.columns) == HEADER  # the configured names
    picked = raw.iloc[table["row"].to_numpy() - FIRST_DATA_ROW]
    assert picked["a_id"].tolist() == table["id"].tolist()
    assert (raw.iloc[: len(TITLE)] == "").all().all()  # sheet rows 2-3 (blank, header): blank


def test_spaces_inside_names_and_the_split_and_template_columns_match(tmp_path, suffix):
    rows = [[*r[:3], r[2], "train" if k < 8 else "val"] for k, r in enumerate(body())]
    sheet = write_rows(
        tmp_path / f"s{suffix}", [["Sample  Class", "A_ITEM", "a_id", "FILE", " Split "], *rows]
    )
    table = load(sheet, class_column="sample class", path_template="wav/{file}.npy")
    assert table["cls"].tolist()[:2] == ["bird", "bird"]
    assert table["path"].iloc[0] == str(tmp_path / "wav" / "00001.npy")
    assert table["split"].tolist() == ["train"] * 8 + ["val"] * 4


def test_parquet_column_names_match_too(tmp_path):
    frame = pd.DataFrame(body(), columns=MESSY_HEADER)
    frame.to_parquet(tmp_path / "index.parquet", index=False)
    table = load(tmp_path / "index.parquet")
    assert table["id"].iloc[0] == "00001" and table["row"].tolist()[:2] == [2, 3]
    with pytest.raises(
        IndexValidationError,
        match=r"index\.parquet is a parquet file.*"
        r"data\.header_row=3 does not apply; set data\.header_row=null",
    ):
        load(tmp_path / "index.parquet", header_row=3)


# ---------------------------------------------------------------------------------------------
# data.header_row


def test_header_row_names_the_header(tmp_path, suffix, notes):
    # row 1 names the columns too (a notes row): only data.header_row tells the real header
    rows = [HEADER, ["the class", "the recording", "the sample", "its file"], MESSY_HEADER]
    sheet = write_rows(tmp_path / f"h{suffix}", [*rows, *body()])
    table = load(sheet, header_row=3)
    assert table["row"].tolist()[:2] == [4, 5] and table["id"].iloc[0] == "00001"
    assert len(table) == 12
    assert notes == [
        f"index file {sheet}: columns matched ignoring case and spaces: 'A_CLS' as "
        "'a_cls' (data.class_column), 'A_Item' as 'a_item' (data.item_column), "
        "'A_ID' as 'a_id' (data.id_column), 'PATH' as 'path' (data.path_column)"
    ]


def test_header_row_that_does_not_hold_the_columns(tmp_path, suffix):
    sheet = write_rows(tmp_path / f"h{suffix}", [*TITLE, HEADER, *body()])
    pattern = (
        r"has no column 'a_cls' \(data\.class_column\).*columns present: 'bird', "
        r"'bird_rec0', '00001'.*data\.header_row=4 reads row 4 as the header: set it to "
        r"the row holding the column names, or to null"
    )
    with pytest.raises(IndexValidationError, match=pattern):
        load(sheet, header_row=4)


def test_header_row_past_the_end(tmp_path, suffix):
    sheet = write_rows(tmp_path / f"h{suffix}", [HEADER, *body()])
    with pytest.raises(
        IndexValidationError,
        match=r"has 13 row\(s\), so data\.header_row=40 "
        r"names no row; set data\.header_row to the row holding the column names",
    ):
        load(sheet, header_row=40)


def test_header_below_the_searched_rows_needs_header_row(tmp_path, suffix):
    notes_rows = [["Recordings"]] + [[f"note {k}"] for k in range(HEADER_SEARCH_ROWS)]
    sheet = write_rows(tmp_path / f"deep{suffix}", [*notes_rows, HEADER, *body()])
    pattern = (
        r"No row among the first 20 holds all of 'a_cls', 'a_item', 'a_id', so row 1 "
        r"was read as the header: if the header is further down, set "
        r"data\.header_row=<its row>"
    )
    with pytest.raises(IndexValidationError, match=pattern):
        load(sheet)
    assert not (tmp_path / ".audioclf_cache").exists()
    table = load(sheet, header_row=22)
    assert table["row"].tolist()[:2] == [23, 24] and len(table) == 12
    last_searched = write_rows(tmp_path / f"row20{suffix}", [*notes_rows[:19], HEADER, *body()])
    assert load(last_searched)["row"].iloc[0] == HEADER_SEARCH_ROWS + 1


@pytest.mark.filterwarnings("ignore:.*fewer than 2 items:UserWarning")
def test_cache_keys_on_header_row(tmp_path, suffix):
    # the header twice: found on row 1, row 2 is a data row of class 'a_cls'; or row 2 is named
    sheet = write_rows(tmp_path / f"twice{suffix}", [HEADER, HEADER, *body()])
    assert len(load(sheet)) == 13
    given = load(sheet, header_row=2)
    assert len(given) == 12 and given["row"].iloc[0] == 3
    assert len(list((tmp_path / ".audioclf_cache").iterdir())) == 2
    assert len(load(sheet)) == 13  # each from its own cache


# ---------------------------------------------------------------------------------------------
# Strict on content


def test_two_columns_matching_one_name_is_an_error(tmp_path, suffix):
    sheet = write_rows(
        tmp_path / f"amb{suffix}",
        [["title"], ["a_cls", "A_CLS", *HEADER[1:]], *[[r[0], *r] for r in body()]],
    )
    pattern = (
        r"amb\.\w+: columns 'a_cls', 'A_CLS' of the header \(row 2\) both match "
        r"data\.class_column='a_cls' \(column names match ignoring case and spaces\); "
        r"rename or delete all but one of them"
    )
    with pytest.raises(IndexValidationError, match=pattern):
        load(sheet)
    assert not (tmp_path / ".audioclf_cache").exists()


def test_errors_name_the_sheets_own_rows(tmp_path, suffix):
    rows = body()
    rows[2][1] = ""  # sheet row 3 + 2 + 1 = 6
    rows[7][2] = rows[6][2]  # rows 10 and 11
    sheet = write_rows(tmp_path / f"bad{suffix}", [*TITLE, MESSY_HEADER, *rows])
    with pytest.raises(IndexValidationError, match=r"column 'a_item' \(item\) is empty in 1 row 6"):
        load(sheet)
    rows[2][1] = "bird_rec1"
    write_rows(sheet, [*TITLE, MESSY_HEADER, *rows])
    with pytest.raises(IndexValidationError, match=r"'00007' at rows 10, 11"):
        load(sheet)


def test_no_data_rows_names_the_header_row(tmp_path, suffix):
    sheet = write_rows(tmp_path / f"empty{suffix}", [*TITLE, HEADER])
    with pytest.raises(
        IndexValidationError,
        match=r"has no data rows \(the header is row 3, data starts at row 4\)",
    ):
        load(sheet)


@pytest.mark.parametrize("engine", ["calamine", "openpyxl"])
def test_excel_text_cells_keep_their_text(tmp_path, monkeypatch, engine):
    """Ids stored as text stay text; numbers typed as numbers read as the number they hold."""
    monkeypatch.setattr(index_module.reader, "_excel_engine", lambda: engine)
    book = openpyxl.Workbook()
    for row in [
        ["Title"],
        HEADER,
        ["x", "i", "00123", "a"],
        ["x", "j", "2026-01-02", "b"],
        ["y", "k", 123, "c"],
        ["y", "l", 4.0, "d"],
    ]:
        book.active.append(row)
    book.save(tmp_path / "typed.xlsx")
    table = load(tmp_path / "typed.xlsx")
    assert table["id"].tolist() == ["00123", "2026-01-02", "123", "4"]
    assert table["row"].tolist() == [3, 4, 5, 6]
