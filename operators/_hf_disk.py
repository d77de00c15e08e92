"""Hugging Face ``save_to_disk`` folders read by ``ReadArrow``: their data files, as listed.

``datasets.Dataset.save_to_disk(path)`` writes a folder of ``dataset_info.json``,
``state.json`` and the table as Arrow IPC *stream* files (``data-00000-of-00001.arrow``, ...),
which ``state.json`` lists under ``_data_files`` in their order. A glob over such a folder
(``ds/*``) would also match the two JSON files, and the folder's own name matches no file;
``expand`` reads such a folder by the data files its ``state.json`` lists. A
``DatasetDict.save_to_disk`` folder (``dataset_dict.json`` and a folder per split) is refused
naming its splits: a source reads one split.
"""

from __future__ import annotations

import json
import os
import posixpath
from typing import Any

from zephon_flow.core import files
from zephon_flow.core.errors import DataError, SpecError

STATE = "state.json"
INFO = "dataset_info.json"
DICT = "dataset_dict.json"
_MAGIC = ("*", "?", "[")


def _join(folder: str, name: str) -> str:
    if files.is_local(folder):
        return os.path.join(folder, name)
    return posixpath.join(folder, name)


def _parent_and_name(path: str) -> tuple[str, str]:
    if files.is_local(path):
        return os.path.dirname(path), os.path.basename(path)
    return posixpath.dirname(path), posixpath.basename(path)


def _exists(path: str, operator: str) -> bool:
    try:
        files.stat(path, operator=operator)
    except DataError:
        return False
    return True


def _named_folder(pattern: str, operator: str) -> str | None:
    """The folder ``pattern`` names (no wildcard, a folder), or None."""
    if any(c in pattern for c in _MAGIC):
        return None
    folder = pattern.rstrip("/") or pattern
    if files.is_local(folder):
        return folder if os.path.isdir(files.local_path(folder)) else None
    if _exists(folder, operator):  # an object of that name: a file
        return None
    return (
        folder if _exists(_join(folder, STATE), operator) or _exists(_join(folder, DICT), operator) else None
    )


def data_files(folder: str, *, operator: str) -> list[str]:
    """The data files of a ``save_to_disk`` folder, in the order its ``state.json`` lists them."""
    state_path = _join(folder, STATE)
    try:
        with files.open_binary(state_path, operator=operator) as fh:
            state: Any = json.loads(fh.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{operator}: {state_path} is not valid JSON: {exc}") from exc
    listed = state.get("_data_files") if isinstance(state, dict) else None
    if (
        not isinstance(listed, list)
        or not listed
        or not all(isinstance(e, dict) and isinstance(e.get("filename"), str) for e in listed)
    ):
        raise DataError(
            f"{operator}: {state_path} does not list the folder's data files "
            f"(_data_files: [{{'filename': ...}}, ...]); is it a Hugging Face save_to_disk folder?"
        )
    out = []
    for entry in listed:
        name = entry["filename"]
        if name != os.path.basename(name) or name in ("", ".", ".."):
            raise DataError(f"{operator}: {state_path} lists {name!r}, not a file of its folder")
        out.append(_join(folder, name))
    return out


def expand(pattern: str, *, operator: str) -> list[str]:
    """The files ``ReadArrow`` reads for ``pattern``: the glob's files, except that a
    ``save_to_disk`` folder (named by the pattern, or whose ``state.json`` the glob matches)
    gives the data files its ``state.json`` lists, in place of the folder's files."""
    folder = _named_folder(pattern, operator)
    if folder is not None:
        if _exists(_join(folder, STATE), operator):
            return data_files(folder, operator=operator)
        if _exists(_join(folder, DICT), operator):
            raise SpecError(_dict_refusal(folder, operator))
        raise SpecError(
            f"{operator}: {pattern!r} is a folder without {STATE} (not a Hugging Face save_to_disk "
            f"folder); give a glob of its Arrow files, e.g. {_join(folder, '*.arrow')!r}"
        )
    paths = files.expand_glob(pattern, operator=operator)
    saved = {_parent_and_name(p)[0] for p in paths if _parent_and_name(p)[1] == STATE}
    out: list[str] = []
    for path in paths:
        parent, name = _parent_and_name(path)
        if parent in saved:
            if name == STATE:  # the folder's data files, where its state.json sorts
                out.extend(data_files(parent, operator=operator))
            continue
        if name == DICT and any(s.startswith(_join(parent, "")) for s in saved):
            continue  # the index of a DatasetDict whose splits the glob reads
        out.append(path)
    return out


def _dict_refusal(folder: str, operator: str) -> str:
    splits: list[str] = []
    try:
        with files.open_binary(_join(folder, DICT), operator=operator) as fh:
            found = json.loads(fh.read().decode("utf-8")).get("splits")
        if isinstance(found, list):
            splits = [str(s) for s in found]
    except (DataError, ValueError, AttributeError):
        pass
    named = ", ".join(splits) or "?"
    example = _join(folder, splits[0] if splits else "train")
    return (
        f"{operator}: {folder!r} is a Hugging Face DatasetDict folder (splits: {named}); a source "
        f"reads one split: name its folder, e.g. ReadArrow({example!r})"
    )
