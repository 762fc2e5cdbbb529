"""Audio sources that are commands (a Kaldi wav.scp entry `sox in.flac -t wav - |`, a Lhotse
recording source of type `command`): `prepare --from ... --run-commands` runs each once, in
parallel, and writes its output (audio on stdout) to a file under the sheet's folder, which the
sheet then lists, so training reads files and never spawns a shell. Without the flag such an
entry is one line naming it.

A command runs without a shell when it is one program with arguments (shlex-split); a real
pipeline (`a | b`, redirections, $VARIABLES, globs) runs under /bin/sh. Commands run in the
folder relative paths resolve against (prepare's --root, else the source's folder).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import soundfile
from tqdm import tqdm

from audioclf.data.formats.records import FormatError
from audioclf.fileio import atomic_write_bytes

_SHELL = re.compile(r"[|&;<>()$`*?~{}\[\]\\\n]")  # what only a shell can run


@dataclass
class CommandSources:
    """The command sources met while reading a source: `audio_file` gives each its file under
    `folder` (None: refused without --run-commands); `run` makes the files."""

    folder: Path | None
    cwd: Path = Path(".")
    pending: dict[str, tuple[str, str]] = field(default_factory=dict)  # file -> (command, where)

    def audio_file(self, key: str, command: str, where: str, what: str = "command pipe") -> str:
        """The file that will hold `command`'s audio (`where`: file:line of the entry)."""
        if self.folder is None:
            raise FormatError(
                f"{where}: the entry is a {what} ({command!r}), which training cannot read: "
                "add --run-commands to run each such command once and list its audio (written "
                "under the sheet's folder), or write the audio to files and list their paths"
            )
        name = re.sub(r"[^A-Za-z0-9._-]", "_", key) or "audio"
        target = str((self.folder / f"{name}.wav").absolute())
        if target in self.pending and self.pending[target][0] != command:
            target = str((self.folder / f"{name}.{len(self.pending)}.wav").absolute())
        self.pending[target] = (command, where)
        return target

    def run(self, progress: bool = True) -> int:
        """Run every pending command once (in parallel) into its file; how many ran. FormatError
        naming the entry when one fails or writes no audio."""
        if not self.pending:
            return 0
        self.folder.mkdir(parents=True, exist_ok=True)
        jobs = list(self.pending.items())
        workers = min(8, os.cpu_count() or 1, len(jobs))
        with (
            ThreadPoolExecutor(workers) as pool,
            tqdm(
                total=len(jobs), desc="running the sources' commands", disable=not progress
            ) as bar,
        ):
            for _ in pool.map(lambda job: self._run_one(Path(job[0]), *job[1]), jobs):
                bar.update(1)
        return len(jobs)

    def _run_one(self, target: Path, command: str, where: str) -> None:
        shell = bool(_SHELL.search(command))
        try:
            done = subprocess.run(
                command if shell else shlex.split(command),
                shell=shell,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                check=False,
            )
        except (OSError, ValueError) as exc:
            raise FormatError(f"{where}: the command {command!r} cannot start: {exc}") from None
        if done.returncode != 0 or not done.stdout:
            said = done.stderr.decode(errors="replace").strip().splitlines()
            raise FormatError(
                f"{where}: the command {command!r} failed (exit status {done.returncode}"
                f"{': ' + said[-1] if said else ''}{', no output' if not done.stdout else ''})"
            )
        atomic_write_bytes(target, done.stdout)
        try:
            soundfile.info(target)
        except (RuntimeError, OSError) as exc:
            target.unlink(missing_ok=True)
            raise FormatError(
                f"{where}: the command {command!r} wrote no audio file soundfile reads ({exc}); "
                "make it write wav to stdout (e.g. sox ... -t wav -)"
            ) from None
