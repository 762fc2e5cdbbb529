"""File-system-safe names of the feature files: DIR/features/<class>/<id>.npy.

Class folders and file names are the class and id with every character other than letters,
digits, '-', '_' and '.' written as %XX (e.g. 'a/b:c' → 'a%2Fb%3Ac'; a leading '.' too); names
that would still meet on a case-insensitive file system, or longer than MAX_NAME_BYTES, get
'~' + a hash of the exact name.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections import defaultdict

FEATURES_DIR = "features"
SAFE_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
MAX_NAME_BYTES = 200  # file names stay well below the usual 255-byte limit (with .tmp around)


def quote_name(name: str) -> str:
    """`name` with characters other than letters, digits, '-', '_', '.' as %XX (UTF-8 bytes).

    Non-ASCII letters and digits are kept, so 'Hund' and '狗' stay readable. Distinct names
    give distinct results ('%' itself is quoted); the result never starts with '.', so it is
    neither hidden nor '.' / '..'.
    """
    out = []
    for ch in name:
        if ch in SAFE_CHARACTERS or (ord(ch) > 127 and ch.isalnum()):
            out.append(ch)
        else:
            out.extend(f"%{byte:02X}" for byte in ch.encode("utf-8"))
    text = "".join(out)
    return "%2E" + text[1:] if text.startswith(".") else text


def _name_hash(name: str) -> str:
    return hashlib.blake2b(name.encode("utf-8"), digest_size=8).hexdigest()


def safe_names(names: list[str]) -> list[str]:
    """File-system-safe, distinct names for distinct `names` (for one folder).

    quote_name, then '~' + a hash of the exact name (never produced by quoting: '~' is quoted)
    for names longer than MAX_NAME_BYTES (cut first) and for names that only a case-insensitive
    or Unicode-normalising file system (macOS, Windows) would confuse.
    """
    quoted = [quote_name(n) for n in names]
    for i, (name, text) in enumerate(zip(names, quoted, strict=True)):
        if len(text.encode("utf-8")) > MAX_NAME_BYTES:
            cut = text.encode("utf-8")[: MAX_NAME_BYTES - 20].decode("utf-8", "ignore")
            quoted[i] = f"{cut}~{_name_hash(name)}"
    folded: dict[str, set[str]] = defaultdict(set)
    for name, text in zip(names, quoted, strict=True):
        folded[unicodedata.normalize("NFKC", text).casefold()].add(name)
    return [
        text
        if len(folded[unicodedata.normalize("NFKC", text).casefold()]) == 1
        else f"{text}~{_name_hash(name)}"
        for name, text in zip(names, quoted, strict=True)
    ]


def feature_paths(classes: list[str], ids: list[str]) -> list[str]:
    """features/<class>/<id>.npy (posix, relative to the output folder) for every row.

    Ids are unique (the index checks it), so with distinct class folders every path is distinct.
    Computed from the whole sheet, so every shard names every file the same way.
    """
    unique_classes = list(dict.fromkeys(classes))
    folder_of = dict(zip(unique_classes, safe_names(unique_classes), strict=True))
    ids_in: dict[str, list[int]] = defaultdict(list)
    for position, cls in enumerate(classes):
        ids_in[cls].append(position)
    paths = [""] * len(ids)
    for cls, positions in ids_in.items():
        for position, name in zip(positions, safe_names([ids[p] for p in positions]), strict=True):
            paths[position] = f"{FEATURES_DIR}/{folder_of[cls]}/{name}.npy"
    return paths
