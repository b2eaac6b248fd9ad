"""Names inside a store: a manifest entry or a symlink that leads out of the store root is refused.

A store may hold files planted by someone else (a copied directory, a shared bucket). The writer only ever
writes plain relative names, so a reader can refuse anything else before it opens a file: an absolute name,
a `..` component, and, on a local disk, a symlink whose target lies outside the (resolved) store root.
"""

from __future__ import annotations

import os
import posixpath

from supervisor.checkpoint.boundedjson import preview


class LeavesStore(ValueError):
    """A name a store file lists, or the path it resolves to, is outside the store root."""

    def __init__(self, rel: str, why: str):
        self.rel, self.why = rel, why
        super().__init__(f"entry {preview(rel, 200)} leaves the store ({why})")


def name_leaves(rel: object) -> str | None:
    """Why the store-relative name `rel` could point outside the store; None for a plain relative name."""
    if not isinstance(rel, str) or not rel:
        return f"expected a relative file name, got {preview(rel)}"
    if "\x00" in rel or "\\" in rel:
        return "a NUL or backslash in the name"
    if posixpath.isabs(rel):
        return "an absolute path"
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "a '..', '.' or empty path component"
    return None


def resolves_outside(root: str, path: str) -> str | None:
    """Why local `path` (inside `root` by name) resolves outside `root` through a symlink; None if it stays."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep):
        return None
    return f"a symlink to {real}, outside {real_root}"
