"""prepare --from kaldi|nemo|lhotse|wespeaker: each fixture imports to the expected sheet, segment
rows read only their span, malformed input is one line naming the file and line, and an
imported Kaldi dir with segments trains."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import soundfile

from audioclf.config import DataConfig
from audioclf.data.formats import FormatError, import_sheet
from audioclf.data.index import TABLE_COLUMNS, IndexValidationError, load_index
from audioclf.data.readers import load_audio
from audioclf.prepare import main as prepare_main
from tests.helpers import FIXTURES, tiny_config

FORMATS = FIXTURES / "formats"  # the peer toolkits' data dirs and manifests
RATE = 8000
FILES = ("id10001/vidA", "id10001/vidB", "id10002/vidC", "id10002/vidD")


def write_wavs(root: Path, files=FILES, seconds: float = 2.0) -> dict[str, np.ndarray]:
    """The fixtures' audio: one 2 s tone per recording, at wav/<spk>/<video>/00001.wav."""
    waves = {}
    t = np.arange(int(seconds * RATE)) / RATE
    for k, name in enumerate(files):
        path = root / "wav" / name / "00001.wav"
        path.parent.mkdir(parents=True, exist_ok=True)
        wave = (0.3 * np.sin(2 * np.pi * (220 + 60 * k) * t) * (1 + t)).astype(np.float32)
        soundfile.write(path, wave, RATE, subtype="FLOAT")
        waves[name] = wave
    return waves


@pytest.fixture
def root(tmp_path) -> Path:
    write_wavs(tmp_path)
    return tmp_path


def imported(kind: str, source: Path, root: Path, **kwargs) -> pd.DataFrame:
    sheet = root / f"{kind}.csv"
    import_sheet(kind, source, sheet, DataConfig(), root=str(root), **kwargs)
    return pd.read_csv(sheet, dtype=str, keep_default_na=False)


def test_kaldi_with_segments_items_are_recordings_and_spans_are_set(root):
    sheet = imported("kaldi", FORMATS / "kaldi", root)
    assert sheet["a_id"].tolist() == [
        "id10001-vidA-0000", "id10001-vidA-0001", "id10001-vidB-0000", "id10002-vidC-0000",
        "id10002-vidD-0000",
    ]  # fmt: skip
    assert sheet["a_cls"].tolist() == ["id10001"] * 3 + ["id10002"] * 2
    assert sheet["a_item"].tolist() == ["vidA", "vidA", "vidB", "vidC", "vidD"]
    assert sheet["start"].tolist() == ["0", "0.75", "0.25", "0.5", "1"]
    assert sheet["end"].tolist() == ["0.75", "1.5", "1.25", "2", "2"]  # -1: to the end
    assert sheet["path"].iloc[0] == str(root / "wav/id10001/vidA/00001.wav")


@pytest.mark.parametrize("source", ["wespeaker", "wespeaker/data.list"])
def test_wespeaker_lists_take_the_voxceleb_video_as_item(root, source):
    sheet = imported("wespeaker", FORMATS / source, root)
    assert sheet["a_id"].tolist() == [f"{name}/00001" for name in FILES]
    assert sheet["a_item"].tolist() == ["vidA", "vidB", "vidC", "vidD"]
    assert sheet["a_cls"].tolist() == ["id10001", "id10001", "id10002", "id10002"]
    assert "start" not in sheet.columns  # whole files: the sheet has no segment columns
    index = load_index(DataConfig(index=str(root / "wespeaker.csv")))
    assert tuple(index.table.columns) == TABLE_COLUMNS  # and its table is as before


def test_nemo_whole_files_and_segments(root):
    whole = imported("nemo", FORMATS / "nemo/manifest.json", root)
    assert whole["a_id"].tolist() == [f"{name}/00001" for name in FILES]
    assert whole["a_item"].tolist() == ["vidA", "vidB", "vidC", "vidD"]
    segments = imported("nemo", FORMATS / "nemo/segments.json", root)
    assert segments["a_id"].tolist() == [
        "id10001/vidA/00001@0",
        "id10001/vidA/00001@0.75",
        "id10002/vidC/00001@0.5",
    ]
    assert segments["a_item"].tolist() == ["id10001/vidA/00001"] * 2 + ["id10002/vidC/00001"]
    assert segments["start"].tolist() == ["0", "0.75", "0.5"]
    assert segments["end"].tolist() == ["0.75", "1.5", "2"]


def test_item_pattern_overrides_the_rule(root):
    sheet = imported("nemo", FORMATS / "nemo/manifest.json", root, item_pattern=r"^(id\d+)/")
    assert sheet["a_item"].tolist() == ["id10001", "id10001", "id10002", "id10002"]


@pytest.mark.parametrize("gz", [False, True])
def test_lhotse_recordings_and_supervisions(root, gz):
    source = FORMATS / "lhotse"
    if gz:
        source = root / "manifests"
        source.mkdir()
        for name in ("recordings", "supervisions"):
            with gzip.open(source / f"vox_{name}_dev.jsonl.gz", "wb") as handle:
                handle.write((FORMATS / f"lhotse/{name}.jsonl").read_bytes())
        source = source / "vox_supervisions_dev.jsonl.gz"  # the recordings found beside it
    sheet = imported("lhotse", source, root)
    assert sheet["a_id"].tolist() == ["sup-a0", "sup-a1", "sup-b0", "sup-c0"]
    assert sheet["a_item"].tolist() == ["vidA", "vidA", "vidB", "vidC"]
    assert sheet["a_cls"].tolist() == ["id10001"] * 3 + ["id10002"]
    assert sheet["start"].tolist() == ["0", "0.75", "0.25", "0.5"]
    assert sheet["end"].tolist() == ["0.75", "1.5", "1.25", "2"]


def test_lhotse_cuts(root):
    sheet = imported("lhotse", FORMATS / "lhotse_cuts/cuts.jsonl", root)
    assert sheet["a_id"].tolist() == ["cut-a0", "cut-b0", "cut-c0"]
    assert sheet["a_item"].tolist() == ["vidA", "vidB", "vidC"]
    assert sheet["start"].tolist() == ["0", "0.25", "0.5"]
    assert sheet["end"].tolist() == ["0.75", "1.25", "2"]


def copy_kaldi(root: Path) -> Path:
    folder = root / "kaldi"
    shutil.copytree(FORMATS / "kaldi", folder)
    return folder


@pytest.mark.parametrize(
    ("file", "line", "text", "expected"),
    [
        ("wav.scp", 2, "vidB sox wav/x.wav -t wav - |", "command pipe"),
        ("segments", 3, "id10001-vidB-0000 vidB 0.25", "<utterance> <recording> <start> <end>"),
        ("segments", 2, "id10001-vidA-0001 vidX 0.75 1.5", "recording 'vidX' is not in"),
        ("segments", 4, "id10002-vidC-0000 vidC 0.5 9.0", "past the end"),
        ("segments", 1, "id10001-vidA-0000 vidA 0.5 0.25", "end > start >= 0"),
        ("utt2spk", 5, "id10002-vidD-0000", "expected '<id> <speaker>'"),
    ],
)
def test_a_malformed_line_is_one_error_naming_file_and_line(root, file, line, text, expected):
    folder = copy_kaldi(root)
    lines = (folder / file).read_text().splitlines()
    lines[line - 1] = text
    (folder / file).write_text("\n".join(lines) + "\n")
    with pytest.raises(FormatError) as caught:
        import_sheet("kaldi", folder, root / "out.csv", DataConfig(), root=str(root))
    message = str(caught.value)
    assert f"{folder / file}:{line}: " in message and expected in message
    assert "\n" not in message and not (root / "out.csv").exists()


def test_malformed_json_lines_and_unsupported_cuts(root):
    manifest = root / "m.json"
    manifest.write_text('{"audio_filepath": "wav/id10001/vidA/00001.wav", "label": "a"}\n{oops\n')
    with pytest.raises(FormatError, match=rf"{manifest}:2: not a JSON line"):
        import_sheet("nemo", manifest, root / "o.csv", DataConfig(), root=str(root))
    cuts = root / "cuts.jsonl"
    cuts.write_text('{"id": "m", "type": "MixedCut", "tracks": []}\n')
    with pytest.raises(FormatError, match=rf"{cuts}:1: cut 'm' is a MixedCut; only MonoCuts"):
        import_sheet("lhotse", cuts, root / "o.csv", DataConfig(), root=str(root))


def test_prepare_from_writes_the_sheet_and_says_the_item_rule(root, capsys):
    out = root / "sheet.xlsx"
    assert prepare_main(["--from", "kaldi", str(FORMATS / "kaldi"), "--out", str(out),
                         "--root", str(root)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "5 rows (5 segments), 2 classes, 4 items" in printed and "recording id" in printed
    assert prepare_main(["--from", "kaldi", str(root / "none"), "--out", str(out)]) == 2
    assert "error:" in capsys.readouterr().err


def test_segment_rows_read_only_their_span(root):
    waves = write_wavs(root)
    import_sheet("kaldi", FORMATS / "kaldi", root / "k.csv", DataConfig(), root=str(root))
    index = load_index(DataConfig(index=str(root / "k.csv")))
    table = index.table
    assert table["start"].tolist() == [0.0, 0.75, 0.25, 0.5, 1.0]
    for path, start, end, name in zip(
        table["path"], table["start"], table["end"], ["id10001/vidA"] * 2 + list(FILES[1:])
    ):
        got = load_audio(path, RATE, (start, end)).numpy()
        np.testing.assert_array_equal(got, waves[name][round(start * RATE) : round(end * RATE)])
    whole = load_index(DataConfig(index=str(root / "k.csv")))  # the cache carries start/end
    pd.testing.assert_frame_equal(whole.table, table)


def test_dataset_crops_and_eval_clips_come_from_the_span(root):
    from audioclf.data.dataset import AudioDataset

    waves = write_wavs(root)
    import_sheet("kaldi", FORMATS / "kaldi", root / "k.csv", DataConfig(), root=str(root))
    cfg = tiny_config(root / "k.csv", root / "runs", "cnn", "features.sample_rate=8000")
    index = load_index(cfg.data)
    clip = AudioDataset.from_index(index, cfg, train=False)[3][0].numpy()
    np.testing.assert_array_equal(clip, waves["id10002/vidC"][4000:16000][2000:10000])
    crop = AudioDataset.from_index(index, cfg, train=True)[(2, 7)][0].numpy()
    span = waves["id10001/vidB"][2000:10000]  # 0.25-1.25 s; a 0.5 s crop inside it
    assert len(crop) == 4000 and any(
        np.array_equal(crop, span[i : i + 4000]) for i in range(len(span) - 3999)
    )


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        ("0.5", "", "have only one of start and end"),
        ("1", "0.5", "end at or before start"),
        ("-1", "0.5", "start before 0"),
        ("x", "1", "hold no number"),
        ("0", "5", "end 5 s is past the end of"),
    ],
)
def test_sheet_validation_checks_segments(root, start, end, expected):
    sheet = root / "s.csv"
    path = root / "wav/id10001/vidA/00001.wav"
    rows = [["a", "i1", "x1", path, "0", "1"], ["a", "i2", "x2", path, start, end]]
    pd.DataFrame(rows, columns=["a_cls", "a_item", "a_id", "path", "start", "end"]).to_csv(
        sheet, index=False
    )
    with pytest.raises(IndexValidationError, match="row 3") as caught:
        load_index(DataConfig(index=str(sheet)), use_cache=False)
    assert expected in str(caught.value)


def test_training_on_an_imported_kaldi_dir_with_segments(tmp_path):
    from audioclf.training.trainer import fit

    speakers = [f"spk{s}" for s in range(6)]
    files = [f"{spk}/rec{r}" for spk in speakers for r in range(2)]
    write_wavs(tmp_path, files, seconds=3.0)
    folder = tmp_path / "data"
    folder.mkdir()
    wav, segments, utt2spk = [], [], []
    for name in files:
        spk, rec = name.split("/")
        wav.append(f"{spk}_{rec} wav/{name}/00001.wav")
        for k in range(3):
            utt = f"{spk}-{rec}-{k}"
            segments.append(f"{utt} {spk}_{rec} {k * 0.9:.1f} {k * 0.9 + 1.0:.1f}")
            utt2spk.append(f"{utt} {spk}")
    for file, lines in [("wav.scp", wav), ("segments", segments), ("utt2spk", utt2spk)]:
        (folder / file).write_text("\n".join(lines) + "\n")
    sheet = tmp_path / "train.csv"
    import_sheet("kaldi", folder, sheet, DataConfig(), root=str(tmp_path))
    cfg = tiny_config(sheet, tmp_path / "runs", "cnn", "features.sample_rate=8000",
                      "train.epochs=1")  # fmt: skip
    result = fit(cfg)
    assert result["step"] > 0


def _pipe_kaldi(root: Path) -> Path:
    """The Kaldi fixture with two wav.scp entries as commands: one program (run without a
    shell) and a real pipeline (run under /bin/sh)."""
    folder = copy_kaldi(root)
    lines = (folder / "wav.scp").read_text().splitlines()
    lines[0] = "vidA cat wav/id10001/vidA/00001.wav |"
    lines[1] = "vidB cat wav/id10001/vidB/00001.wav | cat |"
    (folder / "wav.scp").write_text("\n".join(lines) + "\n")
    return folder


def test_kaldi_pipes_run_once_with_run_commands_and_the_sheet_lists_files(root, capsys):
    folder, out = _pipe_kaldi(root), root / "sheets" / "train.csv"
    code = prepare_main(["--from", "kaldi", str(folder), "--out", str(out), "--root", str(root),
                         "--run-commands", "--quiet"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    sheet = pd.read_csv(out, dtype=str, keep_default_na=False)
    audio = out.parent / "train_audio"
    by_item = dict(zip(sheet["a_item"], sheet["path"], strict=False))
    assert by_item["vidA"] == str(audio / "vidA.wav") and by_item["vidB"] == str(audio / "vidB.wav")
    assert by_item["vidC"] == str(root / "wav/id10002/vidC/00001.wav")
    for item in ("vidA", "vidB"):  # the commands' audio, sample for sample
        written, _ = soundfile.read(by_item[item], dtype="float32")
        original, _ = soundfile.read(root / f"wav/id10001/{item}/00001.wav", dtype="float32")
        np.testing.assert_array_equal(written, original)
    load_index(DataConfig(index=str(out)))  # trains from files: no command in the sheet


def test_without_run_commands_a_pipe_is_one_line_naming_the_flag(root):
    folder = _pipe_kaldi(root)
    with pytest.raises(FormatError) as caught:
        import_sheet("kaldi", folder, root / "out.csv", DataConfig(), root=str(root))
    message = str(caught.value)
    assert message.startswith(f"{folder / 'wav.scp'}:1: the entry is a command pipe ('cat wav/")
    assert "add --run-commands to run each such command once" in message
    assert not (root / "out_audio").exists()


def test_a_failing_command_is_one_line_naming_its_entry(root):
    folder = copy_kaldi(root)
    lines = (folder / "wav.scp").read_text().splitlines()
    lines[2] = "vidC cat wav/missing.wav |"
    (folder / "wav.scp").write_text("\n".join(lines) + "\n")
    with pytest.raises(FormatError) as caught:
        import_sheet("kaldi", folder, root / "out.csv", DataConfig(), root=str(root),
                     run_commands=True, progress=False)  # fmt: skip
    message = str(caught.value)
    assert message.startswith(f"{folder / 'wav.scp'}:3: the command 'cat wav/missing.wav' failed")
    assert not (root / "out.csv").exists()


def test_lhotse_command_sources_run_with_run_commands(root):
    source = root / "lhotse"
    shutil.copytree(FORMATS / "lhotse", source)
    lines = (source / "recordings.jsonl").read_text().splitlines()
    lines[0] = lines[0].replace(
        '{"type": "file", "channels": [0], "source": "wav/id10001/vidA/00001.wav"}',
        '{"type": "command", "channels": [0], "source": "cat wav/id10001/vidA/00001.wav"}',
    )
    (source / "recordings.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(FormatError, match="command source .*add --run-commands"):
        imported("lhotse", source, root)
    sheet = imported("lhotse", source, root, run_commands=True, progress=False)
    assert set(sheet.loc[sheet["a_item"] == "vidA", "path"]) == {
        str(root / "lhotse_audio" / "vidA.wav")
    }
