"""SHA-256 of files: the one helper for checkpoint manifests and the pinned footage videos."""

from __future__ import annotations

import hashlib

__all__ = ["file_sha256"]


def file_sha256(path: str) -> str:
    """Hex SHA-256 of the file at ``path``, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
