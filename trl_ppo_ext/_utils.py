"""Small helpers several modules share: durable JSON files, logging a message once and the
``metadata={"help": ...}`` of config dataclass fields.

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


def optional_number_from_text(value: Any, kind: type, *, owner: str, name: str, off: str) -> Any:
    """A config value as Python has it, from what the command line gives: ``"None"`` -> None and a
    number's text -> ``kind(text)``; anything that is not text is returned as it is.

    argparse cannot produce None, so optional numeric fields are typed ``kind | str | None`` and
    ``HfArgumentParser`` hands over the text; ``__post_init__`` converts it here. ``owner``,
    ``name`` and ``off`` (what None does) word the error for text that is neither.

    Example:
        >>> optional_number_from_text("None", float, owner="PPOConfig", name="dual_clip", off="turns it off")
        >>> optional_number_from_text("3", int, owner="PPOConfig", name="x", off="turns it off")
        3
        >>> optional_number_from_text(0.5, float, owner="PPOConfig", name="x", off="turns it off")
        0.5
    """
    if not isinstance(value, str):
        return value
    if value.strip().lower() == "none":
        return None
    try:
        return kind(value)
    except ValueError:
        article = "an int" if kind is int else "a number"
        raise ValueError(
            f"{owner}.{name} must be {article} or None, got {value!r}; e.g. --{name} None {off}."
        ) from None


def help_metadata(text: str) -> dict:
    """A dataclass field's ``metadata``: ``{"help": text}``, what ``HfArgumentParser`` prints
    for ``--help`` (``field(default=..., metadata=help_metadata("..."))``).

    Example:
        >>> help_metadata("Updates before the guards count.")
        {'help': 'Updates before the guards count.'}
    """
    return {"help": text}
