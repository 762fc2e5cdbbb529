"""A feature pack: many samples' log-mel frames in a few large files, read a crop at a time.

    python -m audioclf.prepare --index SHEET --out DIR --pack      # writes it (data.pack.write)
    data.index=DIR/index.parquet features.kind=npy                 # trains on it like any sheet

A pack folder holds:
    data-00000.bin ...  the samples' frames, back to back, class-major (class, item, id), each a
                        C-order [frames, bins] array of the pack's dtype (float16 by default), no
                        headers: a crop of a sample is one positioned read;
    rows.npy            int64 [N, 6]: (data file, byte offset, frames, the row's position in
                        the source sheet, its source file's bytes and mtime_ns when packed) of
                        every packed sample;
    pack.json           the manifest: format version, dtype, bins, the data files and their sizes,
                        the feature settings (when packed from audio), the source sheet, the
                        checksum of rows.npy and one of itself (an edited pack.json or rows.npy
                        is refused when the pack is opened);
    index.parquet       a sheet like any other (a_cls, a_item, a_id, ...; path = the sample's data
                        file) with two more columns, pack_offset and pack_frames. Written last.

An index whose table has those two columns is packed; `PackedFeatures.of(table, features)` opens
its pack, checked: pack.json and rows.npy match their checksums, every data file has the
manifest's size (a file cut short is one line), every row of the sheet is a sample of rows.npy (a
sheet edited to point elsewhere is one line; rows left out or re-split are fine), the bins and the
feature settings are the config's. A pack of another format version (an older audioclf's) is
refused with one line: pack again. Reading never parses a header or opens a file per crop: each
process opens the data files once, and every check above runs once, when the pack is opened.

format   the constants, the manifest and rows.npy, each checked against its checksum
read     PackedFeatures: the checked pack of a packed index table, read a crop at a time
write    pack_features, the library under `prepare --pack`: durable, resumable, locked
batches  PackedBatchReader: a training run's batches, a unit of batches at a time
"""

from audioclf.data.pack.format import DTYPES, PackError, feature_settings
from audioclf.data.pack.read import PackedFeatures

__all__ = ["DTYPES", "PackError", "PackedFeatures", "feature_settings"]
