"""Small files written whole or not at all: a crash, a full disk or a power cut mid-write leaves the file
as it was, never half of the new one under its name (a config, meta.json, a result a later run reads back).

The text goes to a temporary file beside the target (the same filesystem, so the rename is atomic), is
flushed to disk, and is renamed over the target. Checkpoints, many files at once, have their own
(checkpoint/format.py).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path`, its folder made: all of it, or nothing changed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # unique: two writers never share one
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask's mode, as open() gives (mkstemp: 0600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: a power cut must not leave an empty file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | Path, obj) -> Path:
    """`obj` as indented JSON, atomically (write_text_atomic)."""
    return write_text_atomic(path, json.dumps(obj, indent=2) + "\n")
