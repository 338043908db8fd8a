"""Small helpers several modules share: durable JSON files and logging a message once.

Kept apart so that the checkpoint, manifest, offload and quantization modules depend on this
one instead of on each other.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

# Prefix of the temporary files and folders an atomic write creates next to its target;
# ``checkpoint.clean_temp_dirs`` removes what a crash leaves behind.
TEMP_PREFIX = ".tmp-"

_LOGGED: set[tuple[str, str]] = set()


def log_once(log: logging.Logger, level: int, message: str) -> None:
    """``log.log(level, message)``, at most once per process for the same logger and text."""
    key = (log.name, message)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.log(level, message)


# ---------------------------------------------------------------------- json
def save_json(path: str | os.PathLike, obj: Any, *, indent: int = 2) -> None:
    """Write ``obj`` as JSON to ``path`` atomically: a temporary file in the same folder, fsync,
    ``os.replace``. A reader sees the old file or the new one, never a partial one. NaN and
    inf are written as ``NaN``/``Infinity``, which :func:`load_json` reads back (the guards'
    state may hold them); use ``manifest.to_jsonable`` first where strict JSON is needed.

    Raises:
        TypeError: ``obj`` is not JSON-serialisable (nothing is written then).
    """
    path = Path(path)
    text = json.dumps(obj, indent=indent, sort_keys=False)
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(path.parent)



def load_json(path: str | os.PathLike) -> Any:
    """Read a JSON file.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not valid JSON (cut off by a crash, or damaged); the message
            names the file and the position.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise FileNotFoundError(f"No JSON file at {str(path)!r}.") from err
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{str(path)!r} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); it is damaged "
            "or was cut off while being written."
        ) from err


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename inside ``directory`` durable. Best effort: some systems cannot open folders."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
