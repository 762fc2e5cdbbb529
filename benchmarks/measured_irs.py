"""Measured impulse responses for `augment.ir_dir`, from a Debian package: the KEMAR dummy-head
responses that pd-earplug ships.

For benchmarks/quality.py's `--set augment.ir_dir=...` rows (issue 36). The package
pd-earplug (GPL-2+) carries earplug_data.txt: the MIT Media Lab's KEMAR measurements (Gardner
and Martin, 1994), 368 source directions x 2 ears, 128 taps at 44.1 kHz each: real responses of
a dummy head's ears and microphones, with the resonances, notches and phase that
audioclf's synthetic EQ and rooms lack. Each direction and ear becomes one .wav in OUT:

    apt-get download pd-earplug && dpkg -x pd-earplug_*.deb /tmp/earplug
    .venv/bin/python benchmarks/measured_irs.py --out data/irs/kemar \\
        --from /tmp/earplug/usr/lib/pd/extra/earplug~/earplug_data.txt
    .venv/bin/python benchmarks/measured_irs.py --smoke   # a 2-direction file of the same format

(With the package installed, `--from` defaults to its path.) The smoke mode writes a small file
in that format, converts it and reads the folder back through audioclf's own reader, so a
change to either side shows. Exit 2 with one line when the data file is missing.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from audioclf.data.augment.responses import load_impulse_responses  # noqa: E402

EARPLUG_DATA = Path("/usr/lib/pd/extra/earplug~/earplug_data.txt")
KEMAR_RATE = 44100  # the MIT KEMAR set's sample rate
HEADER = re.compile(r"^\*\* Impulse Index: (\d+), .*File:\s*(\S+)\.wav\s*\*\*$")


def read_earplug(path: Path) -> list[tuple[str, np.ndarray]]:
    """(name, (taps, 2) left/right response) per direction of an earplug_data.txt file: a header
    line naming the KEMAR file, then one line of interleaved left/right samples."""
    responses, name = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = HEADER.match(line.strip())
        if match:
            name = f"{int(match.group(1)):03d}_{match.group(2)}"
        elif line.strip():
            if name is None:
                raise ValueError(f"{path}:{number}: samples before any '** Impulse Index' header")
            samples = np.array(line.split(), dtype=np.float32)
            if samples.size % 2:
                raise ValueError(f"{path}:{number}: an odd number of samples (left/right pairs)")
            responses.append((name, samples.reshape(-1, 2)))
            name = None
    return responses


def write_folder(responses: list[tuple[str, np.ndarray]], out: Path) -> int:
    """One mono .wav per direction and ear (NAME_left.wav, NAME_right.wav); the file count."""
    out.mkdir(parents=True, exist_ok=True)
    for name, pair in responses:
        for ear, column in (("left", 0), ("right", 1)):
            sf.write(out / f"{name}_{ear}.wav", pair[:, column], KEMAR_RATE, subtype="FLOAT")
    return 2 * len(responses)


def smoke_file(folder: Path) -> Path:
    """A two-direction file in earplug_data.txt's format (decaying noise, 128 taps)."""
    rng = np.random.default_rng(0)
    lines = []
    for index, name in enumerate(("H-40e000a", "H0e090a")):
        taps = rng.standard_normal((128, 2)) * np.exp(-np.arange(128) / 12.0)[:, None]
        lines += [
            f"** Impulse Index: {index}, Sub Index: {index}, File:  {name}.wav **",
            " ".join(f"{v:.6f}" for v in taps.ravel()),
        ]
    path = folder / "earplug_data.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="folder to write the .wav responses to")
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=EARPLUG_DATA,
        help="pd-earplug's earplug_data.txt (default: %(default)s)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="convert a 2-direction file of the same format in a temp folder",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        source = smoke_file(Path(scratch)) if args.smoke else args.source
        out = Path(scratch) / "irs" if args.smoke else args.out
        if out is None:
            parser.error("--out is required (or --smoke)")
        if not source.is_file():
            print(
                f"{source}: no such file; apt-get download pd-earplug && dpkg -x "
                "pd-earplug_*.deb DIR, then --from DIR/usr/lib/pd/extra/earplug~/earplug_data.txt"
            )
            return 2
        count = write_folder(read_earplug(source), out)
        read = load_impulse_responses(str(out), 16000)
        taps = sorted(len(r) for r in read)
        print(
            f"wrote {count} responses to {out} (from {source}); "
            f"read back at 16 kHz: {len(read)}, {taps[0]}-{taps[-1]} taps"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
