"""A script's own checkpoint files, versioned into our store, and a chosen version put back in place.

The script writes its files where and when it likes (nanoGPT overwrites `out/ckpt.pt` in place, non-atomically).
`scan()` finds the files matching the glob under the script's working directory and versions each new or
changed one once it has settled (unchanged since the previous scan and `settle_seconds` old, or the script has
exited with status 0 by itself; after a signal or a non-zero exit, a file still changing is a save cut short
and is not versioned), as a checkpoint of the store: each file's bytes are one opaque blob (`opaque.py`), checksummed, and
the commit is the store's (`LocalStore.commit`: staged, renamed, marker last), so a commit cut short leaves the
store as it was, and the next open removes what it staged. Retention is the policy's (`keep_last`, ...),
deletions logged with their reason. A file whose bytes the store already holds is referenced, not copied again,
and a scan that finds the same bytes as the newest version commits nothing.

The supervisor's own files are never matched, whatever the glob: the store, and the `exclude` paths (the
work directory, the lineage directory, the MLflow sqlite file) when they lie under the working directory. A
`**` glob with the work directory under the working directory would otherwise version the store's own blobs.

A file that stays pending (changing, or its step unknown) for `PENDING_SCANS` scans is warned about once per
segment, and so is a glob that has matched nothing once its first save is overdue (`first_save.py`: the script
printed a step past the one its first save was expected by, or `warn_after_seconds` passed since `open()`).

What a version holds depends on the step rule (`steps.py`): with steps from file names, each step is its own
version (the files whose names carry it); otherwise a version is a snapshot of every matched file.

A matched file may resolve outside the working directory through a symlinked directory (`out -> /scratch/out`):
it is versioned with the path it resolved to, and put back through that same path, so long as the link still
resolves there; a file resolving into the supervisor's own files is never matched nor put back.

`restore()` puts a version back: each of its files is first written to a temp file beside the target and
checked against its digest (a damaged blob is a `CheckpointCorrupt` before any file in place changed; the
caller falls back to the next older version), then renamed over it (atomic), unless the bytes in place
already match; matched files that are newer than the version (a
later step, or absent from a snapshot) are taken out of the way, so a script that resumes from the newest file
it finds resumes from the chosen one: removed when the store holds their bytes, else moved under `aside/` in the
store directory (nothing is lost); on a rollback, every version committed after the target is marked abandoned.

Not thread-safe: one owner (the scanner thread, or the runner between segments) drives it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import stat
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from supervisor import __version__
from supervisor.checkpoint.boundedjson import loads_bounded
from supervisor.checkpoint.catalog import Catalog
from supervisor.checkpoint.local import LocalStore, fsync_dir, write_file
from supervisor.checkpoint.manifest import BLOBS, CKPT_PREFIX, STATE, FileEntry, Manifest, TensorRef
from supervisor.checkpoint.options import make_id, parse_id
from supervisor.checkpoint.paths import name_leaves
from supervisor.checkpoint.retention import RetentionPolicy, apply_retention
from supervisor.errors import CheckpointCorrupt, CheckpointError
from supervisor.script import opaque
from supervisor.script.first_save import FirstSave
from supervisor.script.output import glob_regex
from supervisor.script.steps import StepRule

log = logging.getLogger("rollback_supervisor.script")

#: Temp files of a restore end so; a scan never versions them.
TMP_SUFFIX = ".rollback-supervisor-tmp"
#: Under the store directory: matched files a restore took out of the way whose bytes no version holds.
ASIDE = "aside"
#: state.json of a version says what it is.
KIND = "script-files"
#: Scans a matched file may stay pending (changed, not versioned) before a warning says so.
PENDING_SCANS = 5


@dataclass(frozen=True)
class Signature:
    """How a file looked: a change of any of these is a change of the file."""

    size: int
    mtime_ns: int
    ino: int

    @property
    def mtime(self) -> float:
        return self.mtime_ns / 1e9

    @classmethod
    def of(cls, st: os.stat_result) -> Signature:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


#: rel path -> (its signature, the digest of its bytes) for files whose bytes the store holds. Shared between
#: the segments of a lineage so that a file put back in place is not hashed again at the next scan's start.
KnownFiles = dict[str, tuple[Signature, str]]


@dataclass(frozen=True)
class Restored:
    """The version put back in place: its id, step, file paths (relative), and the notes it was saved with."""

    id: str
    step: int
    files: tuple[str, ...]
    notes: dict[str, Any]


class ScriptFiles:
    """Versions the files matching `glob` under `root` into the store at `store_dir` (see module docstring)."""

    def __init__(
        self,
        root: Path,
        glob: str,
        store_dir: Path,
        steps: StepRule,
        *,
        settle_seconds: float = 1.0,
        zip_check: bool = False,
        retention: RetentionPolicy | None = None,
        known: KnownFiles | None = None,
        notes: Mapping[str, Any] | None = None,
        parent_id: str | None = None,
        exclude: Sequence[Path | str] = (),
        sidecar: str | None = None,
        first_save: FirstSave | None = None,
        printed_step: Callable[[], int | None] = lambda: None,
        clock: Callable[[], float] = time.time,
    ):
        self.root, self.glob, self.store_dir = Path(root), glob, Path(store_dir)
        self.steps = steps
        self.settle_seconds = settle_seconds
        self.zip_check = zip_check
        self.retention = retention
        self.known: KnownFiles = known if known is not None else {}
        self.notes = dict(notes or {})
        self.parent_id = parent_id
        self.before_commit: Callable[[], None] | None = (
            None  #: runs once a version is staged (tests crash here)
        )
        self._clock = clock
        self._matcher = glob_regex(glob)
        self._excluded = _under(self.root, [self.store_dir, *exclude])
        # The supervisor's own paths, resolved: a symlink under the root must not lead a version into them. One
        # holding the root itself is given in parts (see `_under`).
        self._real_root = os.path.realpath(self.root)
        self._own_real = tuple(
            own
            for p in [self.store_dir, *exclude]
            if str(p).rstrip("*")
            and not _inside(self._real_root, own := os.path.realpath(str(p).rstrip("*")))
        )
        self._told_resolved: set[str] = set()
        self.sidecar = sidecar  #: the sidecar's relative path: a few bytes of text, never zip-checked
        self._pending: dict[str, int] = {}  # rel -> scans it has been pending without a version
        self._warned_pending: set[str] = set()
        #: When a glob that has matched nothing is warned about; `printed_step`: the step the script printed last.
        self.first_save = first_save if first_save is not None else FirstSave()
        self.printed_step = printed_step
        self._opened_at: float | None = None
        self._ever_matched = False
        self._warned_empty = False
        self._store: LocalStore | None = None
        self._index: dict[str, tuple[TensorRef, FileEntry]] = {}  # digest -> a stored blob holding it
        self._newest: dict[int | None, tuple[str, dict[str, str]]] = {}  # group -> (id, {rel: digest})
        self._seq = 0
        self._seen: dict[str, Signature] = {}  # how each changed file looked at the previous scan
        # Changed files not versioned as they are (there before we watched, or not a whole zip archive).
        self._skipped: dict[str, Signature] = {}

    # -- open / close ---------------------------------------------------------------------------

    def open(self, *, baseline: bool = True) -> ScriptFiles:
        """Take the store's writer lock (cleaning up an interrupted commit), index it, and, with `baseline`,
        note the files already in place so that only later changes are versioned."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._store = LocalStore(self.store_dir)
        self._opened_at = self._clock()
        self._reindex()
        if baseline:
            self._baseline()
        return self

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> ScriptFiles:
        return self.open() if self._store is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def catalog(self) -> Catalog:
        return self._open_store().catalog

    def _open_store(self) -> LocalStore:
        if self._store is None:
            raise CheckpointError(f"{self.store_dir}: script files not open; call open() first")
        return self._store

    def _reindex(self) -> None:
        catalog = self._open_store().catalog
        self._index, self._newest = {}, {}
        for info in catalog.list():  # seq only grows: ids stay unique even after retention deleted the newest
            self._seq = max(self._seq, info.seq)
            try:
                manifest = catalog.manifest(info.id)
            except CheckpointError as exc:
                log.warning("Skipping checkpoint %s of %s: %s", info.id, self.store_dir, exc)
                continue
            files = {f.path: f for f in manifest.files}
            for ref in manifest.tensors.values():
                if ref.blob in files:
                    self._index.setdefault(ref.digest, (ref, files[ref.blob]))
            if not info.abandoned:
                group = info.step if self.steps.per_file else None
                self._newest[group] = (info.id, {rel: ref.digest for rel, ref in manifest.tensors.items()})

    def _baseline(self) -> None:
        """Files in place now count as seen: those the store holds are known, the others left alone until they
        change (their step could not be told: they were written while nobody watched)."""
        for rel, sig in self.matches().items():
            held = self.known.get(rel)
            if held is not None and held[0] == sig:
                continue
            try:
                digest, _ = opaque.file_digest(self.root / rel)
            except OSError:
                continue
            if digest in self._index:
                self.known[rel] = (sig, digest)
            else:
                self._skipped[rel] = sig
                log.info("%s was in place before the segment started; versioned once it changes", rel)

    # -- scanning -------------------------------------------------------------------------------

    def excluded(self, rel: str) -> bool:
        """Whether `rel` is one of the supervisor's own files (the store, the work directory, ...)."""
        for p in self._excluded:
            if rel.startswith(p[:-1]) if p.endswith("*") else rel == p or rel.startswith(p + "/"):
                return True
        return False

    def matches(self) -> dict[str, Signature]:
        """Every regular file matching the glob, by path relative to the root, but the supervisor's own."""
        found = {}
        for path in self.root.glob(self.glob):
            rel = path.relative_to(self.root).as_posix()
            if rel.endswith(TMP_SUFFIX) or self.excluded(rel):
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and not self._resolves_to_own(rel):
                found[rel] = Signature.of(st)
        return found

    def resolved(self, rel: str) -> str | None:
        """Where `rel` resolves when that is outside the root (a symlinked directory); None inside it."""
        real = os.path.realpath(self.root / rel)
        return None if _inside(real, self._real_root) else real

    def _resolves_to_own(self, rel: str) -> bool:
        real = self.resolved(rel)
        if real is None:
            return False
        if any(_inside(real, own) for own in self._own_real):
            if rel not in self._told_resolved:
                self._told_resolved.add(rel)
                log.warning(
                    "%s is not versioned: it resolves to %s, one of the supervisor's own files", rel, real
                )
            return True
        if rel not in self._told_resolved:
            self._told_resolved.add(rel)
            log.info(
                "%s resolves to %s, outside %s (a symlinked directory): versioned, and put back through that "
                "path while the link still resolves there",
                rel,
                real,
                self._real_root,
            )
        return False

    def scan(
        self,
        *,
        final: bool = False,
        clean: bool = True,
        metrics: Mapping[str, float] | Callable[[int], Mapping[str, float]] | None = None,
    ) -> list[str]:
        """Version what changed and has settled; the new ids.

        `final`: the script has exited. With `clean` (status 0, no signal) everything it left has settled;
        otherwise (a signal, a non-zero exit) a file that changed since the previous scan, or is younger than
        `settle_seconds`, may be a save cut short: it is not versioned, and the newest version stays the last
        whole one. `metrics`: the values printed by a version's step (a function of the step), or the last
        values printed; a version whose metrics include a NaN or an infinity is marked unhealthy (never a
        resume or rollback target unless `checkpoint.allow_nonfinite`).
        """
        now = self._clock()
        found = self.matches()
        self._ever_matched = self._ever_matched or bool(found)
        changed: dict[str, Signature] = {}
        waiting: set[str] = set()
        for rel, sig in found.items():
            held = self.known.get(rel)
            if (held is not None and held[0] == sig) or self._skipped.get(rel) == sig:
                self._pending.pop(rel, None)
                continue
            quiet = self._seen.get(rel) == sig and now - sig.mtime >= self.settle_seconds
            settled = (final and clean) or quiet
            self._seen[rel] = sig
            if settled:
                changed[rel] = sig
            else:
                waiting.add(rel)
                if final:
                    log.warning(
                        "%s not versioned: it changed %.2f s before the script ended by a signal or a non-zero "
                        "exit, and may be a save cut short; the newest version stays the last whole one",
                        rel,
                        now - sig.mtime,
                    )
        committed = []
        for group, members in self._groups(found).items():
            todo = [rel for rel in members if rel in changed]
            if todo and not any(rel in waiting for rel in members):
                cid = self._version(group, members, found, todo, final, metrics)
                if cid is not None:
                    committed.append(cid)
        if committed:
            self._retain()
        self._warn_stalled(found, changed, waiting, now)
        return committed

    def _warn_stalled(
        self, found: Mapping[str, Signature], changed: Mapping[str, Any], waiting: set[str], now: float
    ) -> None:
        """Warn once about a file pending for `PENDING_SCANS` scans, and a glob matching nothing when overdue."""
        for rel in [*changed, *waiting]:
            if rel in self.known and self.known[rel][0] == found[rel]:
                self._pending.pop(rel, None)
                continue
            count = self._pending[rel] = self._pending.get(rel, 0) + 1
            if count == PENDING_SCANS and rel not in self._warned_pending:
                self._warned_pending.add(rel)
                log.warning(
                    "%s has been pending for %d scans with no version taken (still being written, or its step "
                    "cannot be told); raise script.checkpoints.scan_seconds above the script's save time, or check "
                    "step_from",
                    rel,
                    count,
                )
        if self._ever_matched or self._warned_empty:
            return
        elapsed = now - (self._opened_at if self._opened_at is not None else now)
        why = self.first_save.overdue(elapsed, self.printed_step())
        if why is not None:
            self._warned_empty = True
            log.warning(
                "script.checkpoints.glob %r has matched no file under %s, and %s; is it relative to the command's "
                "working directory, and does the script save there?",
                self.glob,
                self.root,
                why,
            )

    def _groups(self, found: Mapping[str, Signature]) -> dict[int | None, list[str]]:
        if not self.steps.per_file:
            return {None: sorted(found)} if found else {}
        groups: dict[int | None, list[str]] = {}
        for rel in sorted(found):
            step = self.steps.step(rel, found[rel].mtime)
            if step is not None:
                groups.setdefault(step, []).append(rel)
        return dict(sorted(groups.items(), key=lambda kv: kv[0] or 0))

    def _version(
        self,
        group: int | None,
        members: list[str],
        found: Mapping[str, Signature],
        todo: list[str],
        final: bool,
        metrics_at: Mapping[str, float] | Callable[[int], Mapping[str, float]] | None,
    ) -> str | None:
        """Commit the files of one group as a new version; None when it waits, or nothing changed."""
        for rel in todo:
            if rel == self.sidecar:
                continue  # a few bytes of JSON or text beside the checkpoint, not an archive
            if self.zip_check and (why := _zip_problem(self.root / rel)):
                self._skipped[rel] = found[rel]
                log.warning("%s is not versioned: not a whole zip archive (%s); a save cut short?", rel, why)
                return None
        step = group if group is not None else self._step(todo, found)
        if step is None:
            if final:
                log.warning(
                    "%s not versioned: its step could not be told when the script exited", ", ".join(todo)
                )
            return None
        raw = metrics_at(step) if callable(metrics_at) else metrics_at
        metrics = dict(raw or {})
        store = self._open_store()
        cid = make_id(step, self._seq + 1)
        staged = store.stage(cid)
        try:
            layout = self._stage(cid, staged, members, found)
            if layout is None:
                shutil.rmtree(staged, ignore_errors=True)
                return None
            refs, files, new_blobs, written = layout
            digests = {rel: ref.digest for rel, ref in refs.items()}
            newest = self._newest.get(group)
            if newest is not None and newest[1] == digests:
                shutil.rmtree(staged, ignore_errors=True)
                self._remember(members, found, digests)
                log.info("%s unchanged since checkpoint %s; nothing to version", ", ".join(todo), newest[0])
                return None
            nonfinite = [] if all(math.isfinite(v) for v in metrics.values()) else sorted(refs)
            manifest = self._manifest(cid, step, staged, refs, files, written, metrics, nonfinite)
            if self.before_commit is not None:
                self.before_commit()
            store.commit(cid, staged, manifest.to_bytes(), new_blobs)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        self._seq += 1
        self.parent_id = cid
        for ref in refs.values():
            self._index.setdefault(ref.digest, (ref, files[ref.blob]))
        self._newest[group] = (cid, digests)
        self._remember(members, found, digests)
        health = f"; unhealthy (metrics printed by its step are not finite: {metrics})" if nonfinite else ""
        log.info(
            "Versioned %s as checkpoint %s (step %d, %.1f MB written of %.1f MB)%s",
            ", ".join(members),
            cid,
            step,
            written / 1e6,
            manifest.nbytes / 1e6,
            health,
        )
        return cid

    def _step(self, todo: list[str], found: Mapping[str, Signature]) -> int | None:
        steps = [self.steps.step(rel, found[rel].mtime) for rel in todo]
        return None if any(s is None for s in steps) else max(s for s in steps if s is not None)

    def _stage(
        self, cid: str, staged: str, members: list[str], found: Mapping[str, Signature]
    ) -> tuple[dict[str, TensorRef], dict[str, FileEntry], list[str], int] | None:
        """Each member referenced if the store holds its bytes, else copied into a new blob; None if one changed
        while it was copied (it waits for the next scan)."""
        refs: dict[str, TensorRef] = {}
        files: dict[str, FileEntry] = {}
        new_blobs: list[str] = []
        written = 0
        for i, rel in enumerate(members):
            held = self.known.get(rel)
            if held is not None and held[0] == found[rel] and held[1] in self._index:
                ref, entry = self._index[held[1]]
            else:
                blob = f"{BLOBS}/{cid}.{i}.safetensors"
                local = os.path.join(staged, os.path.basename(blob))
                try:
                    digest, nbytes, xxh, size = opaque.write_blob(
                        self.root / rel, local, rel, {"checkpoint": cid, "file": rel}
                    )
                    after = Signature.of(os.lstat(self.root / rel))
                except OSError as exc:
                    log.info("%s changed while it was copied (%s); trying again at the next scan", rel, exc)
                    return None
                if after != found[rel]:
                    log.info("%s changed while it was copied; trying again at the next scan", rel)
                    return None
                if digest in self._index:  # same bytes as a stored blob: reference that one
                    os.remove(local)
                    ref, entry = self._index[digest]
                else:
                    ref = TensorRef(blob, rel, digest, nbytes, opaque.DTYPE, (nbytes,))
                    entry = FileEntry(blob, size, xxh)
                    new_blobs.append(blob)
                    written += size
            refs[rel] = TensorRef(ref.blob, ref.key, ref.digest, ref.nbytes, opaque.DTYPE, ref.shape)
            files[entry.path] = entry
        return refs, files, new_blobs, written

    def _manifest(
        self,
        cid: str,
        step: int,
        staged: str,
        refs: dict[str, TensorRef],
        files: dict[str, FileEntry],
        written: int,
        metrics: dict[str, float],
        nonfinite: list[str],
    ) -> Manifest:
        state = {"kind": KIND, "files": sorted(refs), **self.notes}
        resolved = {rel: real for rel in sorted(refs) if (real := self.resolved(rel)) is not None}
        if resolved:
            state["resolved"] = resolved  # where each file lay through a symlink when it was versioned
        raw = json.dumps(state, sort_keys=True, allow_nan=False).encode()
        write_file(os.path.join(staged, STATE), raw)
        entries = [
            *files.values(),
            FileEntry(f"{CKPT_PREFIX}{cid}/{STATE}", len(raw), xxhash.xxh3_64_hexdigest(raw)),
        ]
        return Manifest(
            id=cid,
            seq=self._seq + 1,
            step=step,
            wall_time=self._clock(),
            metrics={k: v for k, v in metrics.items() if math.isfinite(v)},
            parent_id=self.parent_id,
            files=entries,
            tensors=refs,
            nbytes=sum(r.nbytes for r in refs.values()),
            written_bytes=written,
            versions={"rollback-supervisor": __version__},
            nonfinite=nonfinite,
        )

    def _remember(self, members: list[str], found: Mapping[str, Signature], digests: dict[str, str]) -> None:
        for rel in members:
            self.known[rel] = (found[rel], digests[rel])
            self._skipped.pop(rel, None)
            self._seen.pop(rel, None)
            self._pending.pop(rel, None)

    def _retain(self) -> None:
        store = self._open_store()
        result = apply_retention(self.retention, store.catalog.list())
        for info, reason in result.delete:
            log.info("Deleting checkpoint %s (%s)", info.id, reason)
            store.delete(info.id)
        if result.delete:
            store.catalog.gc_blobs()
            self._reindex()

    # -- restoring ------------------------------------------------------------------------------

    def restore(self, checkpoint_id: str, *, rollback: bool = False) -> Restored:
        """Put version `checkpoint_id` back in place (see module docstring); on a rollback, abandon later ones."""
        store = self._open_store()
        catalog = store.catalog
        manifest = catalog.manifest(checkpoint_id)
        state = self._state(catalog, checkpoint_id)
        resolved = state.get("resolved") if isinstance(state.get("resolved"), dict) else {}
        for rel in manifest.tensors:
            self._check_target(checkpoint_id, rel, resolved.get(rel))
        fetched: list[tuple[str, Path, str]] = []
        try:
            for rel, ref in sorted(manifest.tensors.items()):
                tmp = self._fetch(catalog, checkpoint_id, rel, ref)
                if tmp is not None:
                    fetched.append((rel, tmp, ref.digest))
        except BaseException:
            for _, tmp, _ in fetched:
                tmp.unlink(missing_ok=True)
            raise
        for i, (rel, tmp, digest) in enumerate(fetched):
            path = self.root / rel
            try:
                os.replace(tmp, path)
            except BaseException:
                for _, rest, _ in fetched[i:]:
                    rest.unlink(missing_ok=True)
                raise
            fsync_dir(str(path.parent))
            self.known[rel] = (Signature.of(os.lstat(path)), digest)
            log.info(
                "Put %s back from checkpoint %s (step %d)", rel, checkpoint_id, parse_id(checkpoint_id)[0]
            )
        notes = {k: v for k, v in state.items() if k not in ("kind", "files", "resolved")}
        for rel in self._newer(manifest):
            self._put_aside(rel, checkpoint_id)
        if rollback:
            target = catalog.get(checkpoint_id)
            for info in catalog.list():
                if info.seq > target.seq and not info.abandoned:
                    store.mark_abandoned(info.id, f"rolled back to {checkpoint_id}")
                    log.info("Checkpoint %s abandoned: the run rolled back to %s", info.id, checkpoint_id)
            self._reindex()
        self.parent_id = checkpoint_id
        return Restored(checkpoint_id, manifest.step, tuple(sorted(manifest.tensors)), notes)

    def _put_aside(self, rel: str, checkpoint_id: str) -> None:
        """Take a matched file newer than the restored version out of the script's way without losing it:
        removed when the store holds its bytes (a version still has them), else moved under `ASIDE` in the
        store directory, where no scan matches it and nothing deletes it."""
        path = self.root / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self.known.pop(rel, None)
            return
        held = self.known.get(rel)
        digest = held[1] if held is not None and held[0] == Signature.of(st) else None
        if digest is None and stat.S_ISREG(st.st_mode):
            try:
                digest, _ = opaque.file_digest(path)
            except OSError:
                digest = None
        self.known.pop(rel, None)
        if digest is not None and digest in self._index:
            path.unlink(missing_ok=True)
            log.info(
                "Removed %s: newer than checkpoint %s, which the run goes back to; the store holds its bytes",
                rel,
                checkpoint_id,
            )
            return
        dest = self.store_dir / ASIDE / f"{checkpoint_id}-{time.strftime('%Y%m%dT%H%M%S')}" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(path, dest)  # a rename on one filesystem, a copy then unlink across two
        log.warning(
            "Moved %s to %s: newer than checkpoint %s, which the run goes back to, and no version of the store "
            "holds its bytes (delete it once it is not needed)",
            rel,
            dest,
            checkpoint_id,
        )

    def _state(self, catalog: Catalog, checkpoint_id: str) -> dict[str, Any]:
        try:
            state = loads_bounded(
                catalog.read(f"{CKPT_PREFIX}{checkpoint_id}/{STATE}"), max_depth=4, what=STATE
            )
        except (OSError, ValueError) as exc:
            raise CheckpointCorrupt(checkpoint_id, f"{STATE}: {exc}") from None
        if not isinstance(state, dict) or state.get("kind") != KIND:
            raise CheckpointCorrupt(
                checkpoint_id,
                f"{STATE}: expected a version of script files (kind {KIND!r}), got {str(state)[:80]}",
            )
        return state

    def _check_target(self, checkpoint_id: str, rel: str, recorded: object = None) -> None:
        """A version only ever writes a path the glob matches, inside the root or where the path resolved (through
        a symlinked directory) when it was versioned, never into the supervisor's own files."""
        why = name_leaves(rel)
        if why is None and not self._matcher.match(rel):
            why = f"it does not match script.checkpoints.glob {self.glob!r}"
        if why is None and self.excluded(rel):
            why = "it is one of the supervisor's own files (its store, work directory or MLflow store)"
        if why is None:
            real = os.path.realpath(self.root / rel)
            if any(_inside(real, own) for own in self._own_real):
                why = f"it resolves to {real}, one of the supervisor's own files"
            elif not _inside(real, self._real_root) and real != recorded:
                was = f"; it resolved to {recorded} when versioned" if isinstance(recorded, str) else ""
                why = (
                    f"it resolves to {real}, outside {self._real_root}{was}; point the symlink back where it "
                    "led when the version was taken"
                )
        if why is not None:
            raise CheckpointCorrupt(checkpoint_id, f"file {rel!r} cannot be put back: {why}")

    def _fetch(self, catalog: Catalog, checkpoint_id: str, rel: str, ref: TensorRef) -> Path | None:
        """The version's bytes of `rel` in a checked temp file beside it; None when the file already holds them.
        CheckpointCorrupt when the blob cannot be read or reads back wrong."""
        target = self.root / rel
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode):
            held = self.known.get(rel)
            digest = held[1] if held is not None and held[0] == Signature.of(st) else None
            if digest is None:
                digest, _ = opaque.file_digest(target)
            if digest == ref.digest:
                self.known[rel] = (Signature.of(st), digest)
                log.info("%s already holds checkpoint %s's bytes", rel, checkpoint_id)
                return None
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}{TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, st.st_mode & 0o7777 if st else 0o644)
        try:
            try:
                digest, _ = opaque.read_blob(catalog.confined(ref.blob), ref.key, fd)
                os.fsync(fd)
            except (OSError, ValueError) as exc:
                raise CheckpointCorrupt(
                    checkpoint_id, f"{ref.blob}: {rel} cannot be read back: {exc}"
                ) from None
            finally:
                os.close(fd)
            if digest != ref.digest:
                raise CheckpointCorrupt(
                    checkpoint_id, f"{ref.blob}: {rel} reads back as {digest}, expected {ref.digest}"
                )
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _newer(self, manifest: Manifest) -> list[str]:
        """Matched files a script could mistake for a newer checkpoint than the restored one."""
        extra = [rel for rel in self.matches() if rel not in manifest.tensors]
        if not self.steps.per_file:
            return extra
        return [rel for rel in extra if (s := self.steps.step(rel, 0.0)) is not None and s > manifest.step]


def _under(root: Path, paths: Sequence[Path | str]) -> tuple[str, ...]:
    """The paths that lie under `root`, relative to it (a trailing `*`: every name starting so). The root
    itself is never excluded (that would exclude every file): its own parts are given one by one instead."""
    real_root = Path(os.path.realpath(root))
    out = []
    for given in paths:
        text = str(given)
        star = text.endswith("*")
        real = Path(os.path.realpath(text.rstrip("*")))
        try:
            rel = real.relative_to(real_root).as_posix()
        except ValueError:
            continue
        if rel not in ("", "."):
            out.append(rel + "*" if star else rel)
    return tuple(out)


def _inside(path: str, root: str) -> bool:
    """Whether the resolved `path` is `root` or lies under it."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _zip_problem(path: Path) -> str | None:
    """Why `path` is not a whole zip archive (torch.save's format), or None; reads every member's CRC."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as exc:
        return str(exc) or type(exc).__name__
    return f"member {bad} fails its CRC" if bad else None
