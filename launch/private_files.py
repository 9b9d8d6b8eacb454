"""What Tandem writes about a run (output.json, TensorBoard runs, traces) holds prompts and answers: private to
the user who ran it, whatever the umask (files 0600, folders 0700)."""
from __future__ import annotations

import os
from pathlib import Path

FILE_MODE, DIR_MODE = 0o600, 0o700


def private_dir(path: Path) -> Path:
    """mkdir -p with the folders it makes 0700 (existing ones are the user's own choice and are kept)."""
    path = Path(path)
    missing = [p for p in [path, *path.parents] if not p.exists()][::-1]
    for folder in missing:
        folder.mkdir(mode=DIR_MODE)
        os.chmod(folder, DIR_MODE)  # mkdir's mode passes through the umask
    return path


def write_private(path: str | Path, text: str) -> None:
    """Write `text` to `path`, created (or truncated) 0600 before any byte is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(text)


def private_files(folder: Path) -> None:
    """What others (TensorBoard, the profiler) wrote under `folder`: 0600 files, 0700 folders."""
    for path in Path(folder).rglob("*"):
        os.chmod(path, DIR_MODE if path.is_dir() else FILE_MODE)
