"""The validated index: reading every format, each validation error, the cache, the splits."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from audioclf.config import DataConfig
from audioclf.data import index as index_module
from audioclf.data.index import (
    TABLE_COLUMNS,
    Index,
    IndexValidationError,
    load_index,
    read_table,
    split_index,
)
from tests.helpers import make_files, sample_rows, write_sheet


@pytest.fixture
def dataset(tmp_path) -> tuple[pd.DataFrame, Path]:
    """A sheet whose files all exist, and its path."""
    frame = sample_rows()
    make_files(frame, tmp_path)
    return frame, write_sheet(frame, tmp_path / "index.xlsx")


def cache_files(sheet: Path) -> list[Path]:
    folder = sheet.parent / ".audioclf_cache"
    return sorted(folder.iterdir()) if folder.exists() else []


def expected_table(frame: pd.DataFrame, root: Path) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "cls": frame["a_cls"],
            "item": frame["a_item"],
            "id": frame["a_id"],
            "path": [str(root / p) for p in frame["path"]],
            "row": np.arange(len(frame), dtype=np.int64) + 2,
            "split": "",
        }
    ).astype({"cls": str, "item": str, "id": str, "path": str, "split": str})


# ---------------------------------------------------------------------------------------------
# Reading


@pytest.mark.parametrize(
    "suffix,engine",
    [(".xlsx", "calamine"), (".xlsx", "openpyxl"), (".csv", None), (".parquet", None)],
)
def test_every_format_reads_the_same_table(tmp_path, monkeypatch, suffix, engine):
    if engine:
        monkeypatch.setattr(index_module.reader, "_excel_engine", lambda: engine)
    frame = sample_rows()
    make_files(frame, tmp_path)
    sheet = write_sheet(frame, tmp_path / f"index{suffix}")
    index = load_index(DataConfig(index=str(sheet)))
    assert list(index.table.columns) == list(TABLE_COLUMNS)
    pd.testing.assert_frame_equal(index.table, expected_table(frame, tmp_path))
    assert index.table["id"].iloc[6] == "007"  # leading zeros survive
    assert index.source == sheet


@pytest.mark.parametrize("engine", ["calamine", "openpyxl"])
def test_excel_cells_read_as_text_like_pandas(tmp_path, monkeypatch, engine):
    """Numbers typed into Excel come back as the text a user sees; text ids keep their zeros."""
    import openpyxl

    monkeypatch.setattr(index_module.reader, "_excel_engine", lambda: engine)
    book = openpyxl.Workbook()
    book.active.append(["a_cls", "a_item", "a_id", "path"])
    book.active.append([3, 4.0, "007", "x.wav"])
    book.active.append([None, None, None, None])  # a blank row keeps the row numbers honest
    book.active.append(["NA", "null", 12345678901234, "y.wav"])
    book.save(tmp_path / "typed.xlsx")
    raw = read_table(tmp_path / "typed.xlsx", DataConfig())
    assert raw.to_dict("list") == {
        "a_cls": ["3", "", "NA"],
        "a_item": ["4", "", "null"],
        "a_id": ["007", "", "12345678901234"],
        "path": ["x.wav", "", "y.wav"],
    }
    with pytest.warns(UserWarning, match="fewer than 2 items"):
        index = load_index(DataConfig(index=str(tmp_path / "typed.xlsx"), check_files=False))
    assert index.table["row"].tolist() == [2, 4]


def test_direct_calamine_reads_what_pandas_reads(tmp_path):
    """read_table calls python-calamine itself (faster); it must agree with pandas' reader."""
    import datetime

    import openpyxl

    book = openpyxl.Workbook()
    book.active.append(["a_cls", None, "a_id", "a_id", " path "])
    book.active.append([1.5, True, datetime.datetime(2024, 1, 2), 3, "x"])
    book.active.append([None, "", 1e20, -7.0, datetime.date(2023, 5, 6)])
    book.active.append(["tail", None, None, None, None])
    book.save(tmp_path / "messy.xlsx")
    ours = read_table(tmp_path / "messy.xlsx", DataConfig())
    pandas = pd.read_excel(
        tmp_path / "messy.xlsx", engine="calamine", dtype=str, keep_default_na=False
    )
    pandas.columns = [c.strip() for c in pandas.columns]
    pd.testing.assert_frame_equal(ours, pandas)


def test_parquet_numbers_read_as_text(tmp_path):
    frame = pd.DataFrame(
        {
            "a_cls": ["x", "x", "y"],
            "a_item": [1.0, 2.0, float("nan")],
            "a_id": np.array([7, 8, 9], dtype=np.int64),
            "path": ["a", "b", "c"],
        }
    )
    sheet = write_sheet(frame, tmp_path / "index.parquet")
    assert read_table(sheet, DataConfig()).to_dict("list") == {
        "a_cls": ["x", "x", "y"],
        "a_item": ["1", "2", ""],
        "a_id": ["7", "8", "9"],
        "path": ["a", "b", "c"],
    }
    with pytest.raises(IndexValidationError, match=r"'a_item' \(item\) is empty in 1 row 4"):
        load_index(DataConfig(index=str(sheet), check_files=False))


def test_unsupported_format(tmp_path):
    (tmp_path / "index.txt").write_text("a_cls,a_item\n")
    pattern = r"index\.txt has an unsupported format '\.txt'.*xlsx"
    with pytest.raises(IndexValidationError, match=pattern):
        read_table(tmp_path / "index.txt", DataConfig())


@pytest.mark.parametrize("engine", ["calamine", "openpyxl"])
def test_unreadable_file(tmp_path, monkeypatch, engine):
    monkeypatch.setattr(index_module.reader, "_excel_engine", lambda: engine)
    (tmp_path / "index.xlsx").write_bytes(b"this is not a spreadsheet")
    with pytest.raises(IndexValidationError, match=r"index\.xlsx could not be read as \.xlsx"):
        load_index(DataConfig(index=str(tmp_path / "index.xlsx")))
    assert cache_files(tmp_path / "index.xlsx") == []


def test_missing_index_file(tmp_path):
    with pytest.raises(IndexValidationError, match=r"nope\.xlsx does not exist; set data\.index"):
        load_index(DataConfig(index=str(tmp_path / "nope.xlsx")))


@pytest.mark.parametrize("engine", ["calamine", "openpyxl"])
def test_sheet_by_name(dataset, monkeypatch, engine):
    monkeypatch.setattr(index_module.reader, "_excel_engine", lambda: engine)
    _, sheet = dataset
    assert len(load_index(DataConfig(index=str(sheet), sheet="Sheet1"))) == 12
    with pytest.raises(IndexValidationError, match=r"index\.xlsx.*'nope'"):
        load_index(DataConfig(index=str(sheet), sheet="nope"))


# ---------------------------------------------------------------------------------------------
# Validation errors: one message naming the file, the rows and the fix; no cache written


def drop_column(name):
    return lambda frame: frame.drop(columns=[name])


def set_cells(column, positions, value):
    def mutate(frame):
        frame.loc[positions, column] = value
        return frame

    return mutate


ERROR_CASES = {
    "missing class column": (
        drop_column("a_cls"),
        {},
        r"index\.xlsx has no column 'a_cls' \(data\.class_column\); columns present: 'a_item', "
        r"'a_id', 'path'.*data\.class_column=<column>",
    ),
    "renamed item column": (
        drop_column("a_item"),
        {"item_column": "source"},
        r"no column 'source' \(data\.item_column\)",
    ),
    "neither path column nor template": (
        drop_column("path"),
        {},
        r"no path column 'path' and data\.path_template is empty.*add a path column.*"
        r"set data\.path_template",
    ),
    "template names a missing column": (
        drop_column("path"),
        {"path_template": "wav/{a_cls}/{sample}.wav"},
        r"data\.path_template 'wav/\{a_cls\}/\{sample\}\.wav' names column\(s\) 'sample'",
    ),
    "empty cells": (
        lambda f: set_cells("a_item", [5, 7], "  ")(set_cells("a_cls", [2], "")(f)),
        {},
        r"empty cells: column 'a_cls' \(class\) is empty in 1 row 4; column 'a_item' \(item\) "
        r"is empty in 2 rows 7, 9",
    ),
    "empty template field": (
        lambda f: set_cells("a_id", [0], "")(f.drop(columns=["path"])),
        {"path_template": "wav/{a_id}.wav", "check_files": False},
        r"column 'a_id' \(id\) is empty in 1 row 2",
    ),
    "duplicate ids": (
        set_cells("a_id", [3, 8], "003"),
        {},
        r"'a_id' \(data\.id_column\) must be unique, but 1 id\(s\) repeat: '003' at rows 4, 5, 10",
    ),
    "missing files": (
        lambda f: f.assign(path=f["path"].where(f.index % 5 != 1, "wav/gone.wav")),
        {},
        r"3 of 12 referenced files do not exist: row 3: \S*/wav/gone\.wav; row 8: .*"
        r"data\.check_files=false",
    ),
    "bad split values": (
        lambda f: f.assign(split=["train"] * 8 + ["training", "val", "", "test"]),
        {},
        r"'split' \(data\.split_column\) must hold train, val or test in every row, but has "
        r"'', 'training' at rows 10, 12",
    ),
    "no data rows": (lambda f: f.iloc[:0], {}, r"index\.xlsx has no data rows"),
    "only blank rows": (lambda f: f.map(lambda _: ""), {}, r"has no data rows"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_validation_error(tmp_path, case):
    mutate, overrides, pattern = ERROR_CASES[case]
    frame = sample_rows()
    make_files(frame, tmp_path)
    sheet = write_sheet(mutate(frame.copy()), tmp_path / "index.xlsx")
    with pytest.raises(IndexValidationError, match=pattern):
        load_index(DataConfig(index=str(sheet), **overrides))
    assert cache_files(sheet) == []


def test_existing_files_are_found_by_listing_folders(dataset, monkeypatch):
    """One os.scandir per folder, not one stat per file (which is slow on network storage)."""
    _, sheet = dataset
    monkeypatch.setattr(os.path, "isfile", lambda p: pytest.fail(f"stat of {p}"))
    assert len(load_index(DataConfig(index=str(sheet), cache=False))) == 12


def test_all_files_missing_points_at_root(dataset, tmp_path):
    _, sheet = dataset
    (tmp_path / "elsewhere").mkdir()
    pattern = r"None of the 12 files exist: is data\.root right"
    with pytest.raises(IndexValidationError, match=pattern):
        load_index(DataConfig(index=str(sheet), root=str(tmp_path / "elsewhere")))


def test_classes_with_one_item_warn(tmp_path):
    frame = sample_rows()
    frame.loc[frame["a_cls"] == "cat", "a_item"] = "cat_rec0"
    sheet = write_sheet(frame, tmp_path / "index.csv")
    cfg = DataConfig(index=str(sheet), check_files=False)
    with pytest.warns(UserWarning, match=r"1 of 3 classes have fewer than 2 items: 'cat'"):
        load_index(cfg)
    with pytest.warns(UserWarning, match=r"fewer than 2 items: 'cat'"):  # also on a cache hit
        load_index(cfg)


# ---------------------------------------------------------------------------------------------
# Paths


def test_path_template_gives_the_same_paths(dataset, tmp_path):
    frame, _ = dataset
    sheet = write_sheet(frame.drop(columns=["path"]), tmp_path / "templated.xlsx")
    template = "wav/{a_cls}/{a_item}/{a_id}.wav"
    index = load_index(DataConfig(index=str(sheet), path_template=template))
    pd.testing.assert_frame_equal(index.table, expected_table(frame, tmp_path))


def test_path_template_with_format_spec(tmp_path):
    frame = sample_rows().drop(columns=["path"])
    sheet = write_sheet(frame, tmp_path / "index.csv")
    index = load_index(
        DataConfig(index=str(sheet), path_template="f/{a_cls!s}-{a_id:>5}.npy", check_files=False)
    )
    assert index.table["path"].iloc[0] == str(tmp_path / "f" / "bird-  001.npy")


def test_path_column_wins_over_template(dataset, tmp_path):
    frame, sheet = dataset
    index = load_index(DataConfig(index=str(sheet), path_template="nowhere/{a_id}.npy"))
    assert index.table["path"].tolist() == [str(tmp_path / p) for p in frame["path"]]


def test_relative_paths_resolve_against_root_absolute_ones_stay(tmp_path):
    frame = sample_rows()
    data_root = tmp_path / "data"
    make_files(frame, data_root)
    frame.loc[0, "path"] = "./" + frame.loc[0, "path"]
    frame.loc[1, "path"] = str(data_root / "wav" / ".." / frame.loc[1, "path"])
    sheet = write_sheet(frame, tmp_path / "sheets" / "index.csv")
    index = load_index(DataConfig(index=str(sheet), root=str(data_root)))
    paths = index.table["path"].tolist()
    assert paths[0] == str(data_root / "wav/bird/bird_rec0/001.wav")
    assert paths[1] == str(data_root / "wav/bird/bird_rec0/002.wav")
    assert paths[2] == str(data_root / "wav/bird/bird_rec1/003.wav")


def test_relative_root_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    frame = sample_rows()
    make_files(frame, tmp_path / "data")
    sheet = write_sheet(frame, tmp_path / "index.csv")
    monkeypatch.chdir(tmp_path)
    index = load_index(DataConfig(index="index.csv", root="data"))
    assert index.table["path"].iloc[0] == str(tmp_path / "data/wav/bird/bird_rec0/001.wav")
    assert index.source == sheet


# ---------------------------------------------------------------------------------------------
# Cache


def forbid_parsing(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("read_table was called on a cache hit")

    monkeypatch.setattr(index_module, "read_table", fail)


def test_second_load_reads_the_cache(dataset, monkeypatch):
    _, sheet = dataset
    first = load_index(DataConfig(index=str(sheet)))
    assert len(cache_files(sheet)) == 1
    forbid_parsing(monkeypatch)
    second = load_index(DataConfig(index=str(sheet)))
    pd.testing.assert_frame_equal(first.table, second.table)
    assert second.classes == ["bird", "cat", "dog"]


def test_cache_dir_setting(dataset, tmp_path, monkeypatch):
    _, sheet = dataset
    cfg = DataConfig(index=str(sheet), cache_dir=str(tmp_path / "cache"))
    load_index(cfg)
    assert cache_files(sheet) == [] and len(list((tmp_path / "cache").iterdir())) == 1
    forbid_parsing(monkeypatch)
    assert len(load_index(cfg)) == 12


def test_no_cache_when_disabled(dataset):
    _, sheet = dataset
    load_index(DataConfig(index=str(sheet), cache=False))
    load_index(DataConfig(index=str(sheet)), use_cache=False)
    assert cache_files(sheet) == []


def test_editing_the_sheet_invalidates_the_cache(dataset, tmp_path):
    frame, xlsx = dataset
    load_index(DataConfig(index=str(xlsx)))
    frame.loc[0, "a_item"] = "bird_rec9"
    write_sheet(frame, xlsx)
    assert load_index(DataConfig(index=str(xlsx))).table["item"].iloc[0] == "bird_rec9"
    assert len(cache_files(xlsx)) == 1  # the stale cache was replaced, not kept beside

    csv = write_sheet(frame, tmp_path / "index.csv")
    load_index(DataConfig(index=str(csv)))
    stat = csv.stat()
    frame.loc[0, "a_id"] = "101"  # same size, and the old mtime put back: only the content tells
    write_sheet(frame, csv)
    os.utime(csv, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert csv.stat().st_size == stat.st_size
    assert load_index(DataConfig(index=str(csv))).table["id"].iloc[0] == "101"


def test_changing_the_config_does_not_reuse_the_cache(dataset, tmp_path):
    frame, sheet = dataset
    load_index(DataConfig(index=str(sheet)))
    make_files(frame, tmp_path / "other")
    index = load_index(DataConfig(index=str(sheet), root=str(tmp_path / "other")))
    assert index.table["path"].iloc[0].startswith(str(tmp_path / "other"))


def test_corrupt_cache_is_rebuilt(dataset, monkeypatch):
    _, sheet = dataset
    first = load_index(DataConfig(index=str(sheet)))
    (cache,) = cache_files(sheet)
    cache.write_bytes(cache.read_bytes()[:100])
    rebuilt = load_index(DataConfig(index=str(sheet)))
    pd.testing.assert_frame_equal(first.table, rebuilt.table)
    forbid_parsing(monkeypatch)  # the rebuilt cache is whole again
    pd.testing.assert_frame_equal(first.table, load_index(DataConfig(index=str(sheet))).table)


def test_cache_hit_still_checks_files_when_the_cache_did_not(tmp_path):
    frame = sample_rows()
    sheet = write_sheet(frame, tmp_path / "index.xlsx")  # no files on disk
    load_index(DataConfig(index=str(sheet), check_files=False))
    with pytest.raises(IndexValidationError, match=r"12 of 12 referenced files do not exist"):
        load_index(DataConfig(index=str(sheet), check_files=True))


def test_file_check_is_recorded_in_the_cache(dataset, tmp_path, monkeypatch):
    _, sheet = dataset
    load_index(DataConfig(index=str(sheet), check_files=False))
    load_index(DataConfig(index=str(sheet), check_files=True))  # checks, records it
    monkeypatch.setattr(
        index_module.validate, "_missing_files", lambda paths: pytest.fail("re-checked")
    )
    forbid_parsing(monkeypatch)
    assert len(load_index(DataConfig(index=str(sheet), check_files=True))) == 12


# ---------------------------------------------------------------------------------------------
# Index and splits


def synthetic_index(classes=40, items=4, ids=2, seed=0) -> Index:
    rng = np.random.default_rng(seed)
    rows = [
        (f"c{c:02d}", f"c{c:02d}_i{i}", f"c{c:02d}_i{i}_{k}")
        for c in range(classes)
        for i in range(items)
        for k in range(ids)
    ]
    table = pd.DataFrame(rows, columns=["cls", "item", "id"]).iloc[rng.permutation(len(rows))]
    table = table.reset_index(drop=True).assign(
        path=lambda t: "/x/" + t["id"], row=np.arange(len(rows)) + 2, split=""
    )
    return Index(
        table.astype({"cls": str, "item": str, "id": str, "path": str, "split": str}),
        Path("/x/index.xlsx"),
    )


def test_classes_labels_subset():
    index = synthetic_index(classes=3)
    assert index.classes == ["c00", "c01", "c02"]
    labels = index.labels()
    assert labels.dtype == np.int64
    assert [index.classes[k] for k in labels] == index.table["cls"].tolist()
    part = index.subset((index.table["cls"] != "c00").to_numpy())
    assert part.classes == ["c01", "c02"] and part.labels().max() == 1 and len(part) == 16
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        index.subset([True, False, True])


def split_sets(splits, column):
    return {name: set(part.table[column]) for name, part in splits.items()}


def test_class_holdout_is_deterministic_and_disjoint():
    index = synthetic_index()
    cfg = DataConfig(holdout="classes", val_ratio=0.25, seed=3)
    splits = split_index(index, cfg)
    assert set(splits) == {"train", "val"}
    classes = split_sets(splits, "cls")
    assert not classes["train"] & classes["val"]
    assert len(classes["val"]) == 10 and len(splits["train"]) + len(splits["val"]) == len(index)
    assert split_sets(split_index(index, cfg), "cls") == classes
    other_seed = DataConfig(holdout="classes", val_ratio=0.25, seed=4)
    other = split_sets(split_index(index, other_seed), "cls")
    assert other != classes
    shuffled = index.subset(np.ones(len(index), bool))
    shuffled.table = shuffled.table.iloc[::-1].reset_index(drop=True)
    assert split_sets(split_index(shuffled, cfg), "cls") == classes  # row order does not matter


def test_class_holdout_keeps_a_class_on_each_side():
    index = synthetic_index(classes=2)
    for ratio in (0.01, 0.99):
        classes = split_sets(split_index(index, DataConfig(val_ratio=ratio)), "cls")
        assert len(classes["train"]) == 1 and len(classes["val"]) == 1
    assert len(split_index(index, DataConfig(val_ratio=0.0))["val"]) == 0


def test_item_holdout_shares_classes_not_items():
    index = synthetic_index(items=5)
    single = index.subset(
        (index.table["item"] != "c07_i1") & (index.table["cls"] != "c07")
        | (index.table["item"] == "c07_i0")
    )
    cfg = DataConfig(holdout="items", val_ratio=0.2, seed=1)
    splits = split_index(single, cfg)
    items, classes = split_sets(splits, "item"), split_sets(splits, "cls")
    assert not items["train"] & items["val"]
    assert classes["val"] == classes["train"] - {"c07"}  # the one-item class stays in train
    assert "c07_i0" in items["train"]
    assert len(items["val"]) == 39  # one of five items in each of 39 classes
    assert split_sets(split_index(single, cfg), "item") == items
    assert split_sets(split_index(single, DataConfig(holdout="items", seed=2)), "item") != items


@settings(max_examples=40, deadline=None)
@given(
    items_per_class=st.lists(st.integers(1, 5), min_size=1, max_size=12),
    ratio=st.sampled_from([0.0, 0.1, 0.2, 0.5, 0.9]),
    seed=st.integers(0, 3),
    holdout=st.sampled_from(["classes", "items"]),
)
def test_generated_split_is_a_partition(items_per_class, ratio, seed, holdout):
    rows = [
        (f"c{c}", f"c{c}_i{i}", f"c{c}_i{i}_{k}")
        for c, n in enumerate(items_per_class)
        for i in range(n)
        for k in range(2)
    ]
    table = pd.DataFrame(rows, columns=["cls", "item", "id"]).assign(path="/x", row=2, split="")
    index = Index(
        table.astype({"cls": str, "item": str, "id": str, "path": str, "split": str}),
        Path("/x.csv"),
    )
    cfg = DataConfig(holdout=holdout, val_ratio=ratio, seed=seed)
    splits = split_index(index, cfg)
    ids = split_sets(splits, "id")
    assert not ids["train"] & ids["val"] and len(ids["train"] | ids["val"]) == len(index)
    reversed_rows = Index(index.table.iloc[::-1].reset_index(drop=True), index.source)
    assert split_sets(split_index(reversed_rows, cfg), "id") == ids
    classes, items = split_sets(splits, "cls"), split_sets(splits, "item")
    assert not items["train"] & items["val"]
    if holdout == "classes":
        assert not classes["train"] & classes["val"]
        if ratio > 0 and len(items_per_class) >= 2:
            assert classes["train"] and classes["val"]
    else:
        assert classes["val"] <= classes["train"]
        multi = {f"c{c}" for c, n in enumerate(items_per_class) if n >= 2}
        assert classes["val"] == (multi if ratio > 0 else set())


def test_split_column_is_honoured(tmp_path):
    frame = sample_rows().assign(split=["Train"] * 6 + ["val"] * 4 + ["test"] * 2)
    sheet = write_sheet(frame, tmp_path / "index.csv")
    index = load_index(DataConfig(index=str(sheet), check_files=False))
    splits = split_index(index, DataConfig(seed=5))
    assert {k: len(v) for k, v in splits.items()} == {"train": 6, "val": 4, "test": 2}
    assert splits["test"].table["id"].tolist() == ["011", "012"]
    no_test = write_sheet(frame.assign(split=["train"] * 8 + ["val"] * 4), tmp_path / "b.csv")
    index = load_index(DataConfig(index=str(no_test), check_files=False))
    assert set(split_index(index, DataConfig())) == {"train", "val"}


def test_empty_split_column_means_generated_split(tmp_path):
    sheet = write_sheet(sample_rows().assign(split=""), tmp_path / "index.csv")
    index = load_index(DataConfig(index=str(sheet), check_files=False))
    assert (index.table["split"] == "").all()
    classes = split_sets(split_index(index, DataConfig(val_ratio=0.34)), "cls")
    assert len(classes["val"]) == 1 and len(classes["train"]) == 2


def test_stratified_subset_takes_every_class_round_by_round():
    from audioclf.data.index import stratified_subset

    classes = np.repeat(np.arange(5), [40, 3, 10, 1, 6])
    chosen = stratified_subset(classes, 12, seed=0)
    assert len(chosen) == 12 and len(set(chosen.tolist())) == 12
    assert sorted(np.bincount(classes[chosen], minlength=5).tolist()) == [1, 2, 3, 3, 3]
    assert np.array_equal(chosen, stratified_subset(classes, 12, seed=0))  # fixed per seed
    assert not np.array_equal(chosen, stratified_subset(classes, 12, seed=1))
    assert np.array_equal(stratified_subset(classes, 60, seed=0), np.arange(60))
