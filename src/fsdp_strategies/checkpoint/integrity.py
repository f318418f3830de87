"""Checkpoint integrity: checksums written with every save, verified before anything is loaded.

DCP keeps no checksums, and a torch zip file read with ``mmap`` is not CRC-checked: 64 overwritten
bytes inside a weight load silently and train on as NaN. Two forms, both written *inside* the
atomic save (so a checkpoint and its checksums appear together or not at all):

* a sharded (DCP) folder gets ``fsdp_strategies_manifest.json``: the SHA-256 and size of every
  file in it. The ranks hash their share of the files right after DCP has written them, rank 0
  writes the manifest before the folder is renamed into place. Verification reads only JSON and
  raw bytes: nothing is unpickled before ``.metadata`` and every shard match the manifest, and
  missing, extra, truncated or swapped files are named.
* a single-file checkpoint carries its digest inside: key ``fsdp_strategies_integrity`` holds the
  SHA-256 of a canonical walk over every other entry (tensor bytes, shapes, dtypes, keys and plain
  values). The file is read with ``torch.load(weights_only=True)`` (see
  :mod:`fsdp_strategies.checkpoint.safe_load`) and then checked, so the digest travels with the file through
  any ``CheckpointIO``.

Checkpoints without either (older ones, Lightning's own strategies) load with a warning; the
``fsdp-strategies-verify`` command reports them as "no manifest". A checksum detects accidents
(bit rot, torn copies, truncation), not an attacker who rewrites the manifest too: see the
trust model in docs/checkpoints.md.

This module imports nothing from the package but the base layer's one-file atomic write (it only hashes
bytes and compares records); reading
files with the restricted loader and the ``fsdp-strategies-verify`` command are in
:mod:`fsdp_strategies.checkpoint.verify`. What a verification found is a :class:`VerifyResult`; every
caller decides what to do with it through :meth:`VerifyResult.require_intact` (load / export) or
:class:`VerifyStatus`'s tag and exit status (the command), never by comparing status strings.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fsdp_strategies._atomic_file import write_text_atomically

__all__ = [
    "INTEGRITY_KEY",
    "MANIFEST_FILE",
    "CheckpointFiles",
    "CheckpointIntegrityError",
    "LocalFiles",
    "VerifyResult",
    "VerifyStatus",
    "embed_digest",
    "hash_files",
    "manifest_text",
    "parse_manifest",
    "verify_files",
    "verify_folder",
    "verify_loaded",
    "write_manifest",
]

MANIFEST_FILE = "fsdp_strategies_manifest.json"
INTEGRITY_KEY = "fsdp_strategies_integrity"
ALGORITHM = "sha256"
MANIFEST_VERSION = 1
_CHUNK = 8 << 20
FIX_CORRUPT = "Fix: resume from another checkpoint (e.g. the previous one); this one cannot be trusted."


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint's bytes do not match the checksums written when it was saved."""


class VerifyStatus(enum.StrEnum):
    """What a verification found, least to most severe. The values are the strings the package has always
    reported (``result.status == "corrupt"`` holds); each status carries its command-line tag and exit
    status."""

    OK = "ok"
    NO_MANIFEST = "no_manifest"  # no checksums to compare with: cannot be verified
    CORRUPT = "corrupt"

    @property
    def tag(self) -> str:
        """The prefix of a ``fsdp-strategies-verify`` line: ``OK``, ``NO MANIFEST``, ``CORRUPT``."""
        return self.value.replace("_", " ").upper()

    @property
    def exit_code(self) -> int:
        """``fsdp-strategies-verify``'s exit status: 0 verified, 1 corrupted/unreadable, 2 no manifest."""
        return _EXIT_CODES[self]

    @classmethod
    def worst(cls, statuses: Iterable[VerifyStatus]) -> VerifyStatus:
        """The most severe of ``statuses`` (``OK`` for none)."""
        order = list(cls)
        return max(statuses, key=order.index, default=cls.OK)


_EXIT_CODES = {VerifyStatus.OK: 0, VerifyStatus.CORRUPT: 1, VerifyStatus.NO_MANIFEST: 2}


@dataclass(frozen=True)
class VerifyResult:
    """``status``: a :class:`VerifyStatus`; ``message``: one line; ``problems``: every problem found."""

    status: VerifyStatus
    message: str
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status is VerifyStatus.OK

    def require_intact(self) -> str | None:
        """Before a checkpoint is used: raise :class:`CheckpointIntegrityError` when it is corrupt; return the
        message of one that cannot be verified (no checksums: the caller warns and goes on); None when
        verified."""
        if self.status is VerifyStatus.CORRUPT:
            raise CheckpointIntegrityError(self.message)
        return self.message if self.status is VerifyStatus.NO_MANIFEST else None


def file_digest(path: pathlib.Path) -> str:
    """SHA-256 of a file's bytes, read in chunks (the OS cache usually still holds a file just written)."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: pathlib.Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST_FILE)


def _describe(entries: Mapping[str, tuple[int, str]]) -> dict[str, dict[str, Any]]:
    return {name: {"size": size, ALGORITHM: digest} for name, (size, digest) in sorted(entries.items())}


def hash_files(folder: pathlib.Path, names: list[str]) -> dict[str, tuple[int, str]]:
    """``{name: (size, sha256)}`` for ``names`` (relative to ``folder``)."""
    return {name: ((folder / name).stat().st_size, file_digest(folder / name)) for name in names}


def write_manifest(folder: pathlib.Path, hashed: Mapping[str, tuple[int, str]]) -> None:
    """Rank 0, last step before the folder is committed: hash what nobody hashed yet and write the
    manifest."""
    present = _files(folder)
    missing = [n for n in present if n not in hashed]
    entries = {**{n: hashed[n] for n in present if n in hashed}, **hash_files(folder, missing)}
    gone = sorted(set(hashed) - set(present))
    if gone:
        raise CheckpointIntegrityError(f"{folder}: files vanished while the checkpoint was written: {gone}")
    write_text_atomically(folder / MANIFEST_FILE, manifest_text(entries))


class CheckpointFiles(Protocol):
    """Where a sharded checkpoint's files are, as verification needs them: a local folder
    (:class:`LocalFiles`) or objects under a URL (:mod:`fsdp_strategies.checkpoint.object_store`)."""

    where: str  # names the checkpoint in messages

    def manifest_text(self) -> str | None:
        """The manifest's text; None when there is none."""

    def sizes(self) -> dict[str, int]:
        """Every file of the checkpoint but the manifest: relative name -> size in bytes."""

    def digest(self, name: str) -> str:
        """SHA-256 of one file (raises OSError when unreadable)."""


@dataclass(frozen=True)
class LocalFiles:
    """A DCP folder on a local or mounted file system, its manifest inside it."""

    folder: pathlib.Path

    @property
    def where(self) -> str:
        return str(self.folder)

    def manifest_text(self) -> str | None:
        path = self.folder / MANIFEST_FILE
        return path.read_text() if path.is_file() else None

    def sizes(self) -> dict[str, int]:
        return {name: (self.folder / name).stat().st_size for name in _files(self.folder)}

    def digest(self, name: str) -> str:
        return file_digest(self.folder / name)


def manifest_text(hashed: Mapping[str, tuple[int, str]], **extra: Any) -> str:
    """The manifest's JSON for ``{name: (size, sha256)}`` (``extra``: more top-level fields)."""
    return json.dumps({"format": "fsdp_strategies checkpoint manifest", "version": MANIFEST_VERSION,
                       "algorithm": ALGORITHM, **extra, "files": _describe(hashed)}, indent=1)


def parse_manifest(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the manifest's fields, None), or (None, problem) when it is unreadable."""
    try:
        data = json.loads(text)
        files = data["files"]
        if data.get("algorithm") != ALGORITHM or not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get(ALGORITHM), str)
            for v in files.values()
        ):
            raise ValueError("unexpected layout")
    except (ValueError, KeyError, TypeError) as err:
        return None, f"{MANIFEST_FILE}: unreadable manifest ({type(err).__name__}: {err})"
    return data, None


def _read_manifest(found: CheckpointFiles) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """(files, None), (None, None) when there is no manifest, or (None, problem)."""
    try:
        text = found.manifest_text()
    except OSError as err:
        return None, f"{MANIFEST_FILE}: unreadable manifest ({type(err).__name__}: {err})"
    if text is None:
        return None, None
    data, problem = parse_manifest(text)
    return (None, problem) if data is None else (data["files"], None)


def _listing_problems(found: CheckpointFiles, files: Mapping[str, Mapping[str, Any]]) -> list[str]:
    sizes = found.sizes()
    present = set(sizes)
    problems = [f"{name}: missing (listed in the manifest)" for name in sorted(set(files) - present)]
    problems += [f"{name}: unknown file (not in the manifest)" for name in sorted(present - set(files))]
    for name in sorted(present & set(files)):
        size = sizes[name]
        if size != files[name]["size"]:
            problems.append(
                f"{name}: size {size} bytes, the manifest says {files[name]['size']} (truncated or replaced)"
            )
    return problems


def _hash_problems(
    found: CheckpointFiles, files: Mapping[str, Mapping[str, Any]], names: list[str]
) -> list[str]:
    problems = []
    for name in names:
        try:
            digest = found.digest(name)
        except OSError as err:
            problems.append(f"{name}: unreadable ({err.strerror or err})")
            continue
        if digest != files[name][ALGORITHM]:
            problems.append(f"{name}: {ALGORITHM} mismatch (content changed after it was written)")
    return problems


def _single(obj: Any) -> list[Any]:
    return [obj]


def verify_folder(folder: pathlib.Path, *, rank: int = 0, world_size: int = 1,
                  all_gather: Callable[[Any], list[Any]] = _single) -> VerifyResult:
    """Check a DCP folder against its manifest; with several ranks each hashes a share of the files.

    Every rank must call it (``all_gather`` is a collective); every rank gets the same result.
    Reads only the JSON manifest and raw bytes.
    """
    return verify_files(LocalFiles(folder), rank=rank, world_size=world_size, all_gather=all_gather)


def verify_files(found: CheckpointFiles, *, rank: int = 0, world_size: int = 1,
                 all_gather: Callable[[Any], list[Any]] = _single) -> VerifyResult:
    """:func:`verify_folder` for any :class:`CheckpointFiles` (a local folder, objects under a URL)."""
    files, problem = _read_manifest(found)
    if files is None and problem is None:
        local: list[str] | None = None
    elif problem is not None:
        local = [problem]
    else:
        try:
            local = _listing_problems(found, files)
        except OSError as err:
            local = [f"unreadable listing ({type(err).__name__}: {err})"]
        if not local:  # hash only what exists at the right size; the share is by sorted name
            local = _hash_problems(found, files, sorted(files)[rank::world_size])
    gathered = all_gather(local)
    folder = found.where
    if any(g is None for g in gathered):
        return VerifyResult(VerifyStatus.NO_MANIFEST,
                            f"{folder}: no manifest ({MANIFEST_FILE}); written by an older version or "
                            "another tool, so it cannot be verified")
    problems = tuple(sorted({p for g in gathered for p in g}))
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        return VerifyResult(
            VerifyStatus.CORRUPT,
            f"checkpoint {folder} is corrupted: {problems[0]}{more}. {FIX_CORRUPT}",
            problems,
        )
    assert files is not None
    return VerifyResult(VerifyStatus.OK, f"{folder}: {len(files)} files match the manifest ({ALGORITHM})")


# ------------------------------------------------------------------------------ single-file checkpoints
def _walk(h: Any, obj: Any) -> None:
    """Feed a canonical, type-tagged serialisation of ``obj`` into ``h`` (same result after save + load)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if hasattr(t, "to_local"):  # a DTensor: its local part (never a collective from inside a save)
            t = t.to_local()
        t = t.cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, Mapping):
        items = sorted(obj.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        h.update(f"M{len(items)}".encode())
        for key, value in items:
            _walk(h, key)
            _walk(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}".encode())
        for value in obj:
            _walk(h, value)
    elif isinstance(obj, (set, frozenset)):
        _walk(h, sorted(obj, key=repr))
    elif obj is None or isinstance(obj, (str, bytes, bool, int, float, complex, torch.dtype, torch.device,
                                         torch.Size, enum.Enum, pathlib.PurePath)):
        h.update(f"P{type(obj).__name__}:{obj!r};".encode())
    elif hasattr(obj, "tobytes") and hasattr(obj, "dtype") and hasattr(obj, "shape"):  # numpy arrays
        h.update(f"A{obj.dtype}{tuple(obj.shape)}".encode())
        h.update(obj.tobytes())
    elif hasattr(obj, "__dict__"):  # e.g. a Namespace: its fields
        h.update(f"O{type(obj).__qualname__}".encode())
        _walk(h, vars(obj))
    else:  # an allow-listed object without fields: its type and printable value
        h.update(f"X{type(obj).__qualname__}:{obj!r};".encode())


def content_digest(checkpoint: Mapping[str, Any]) -> str:
    """SHA-256 over every entry of ``checkpoint`` except the integrity record itself."""
    h = hashlib.sha256()
    _walk(h, {k: v for k, v in checkpoint.items() if k != INTEGRITY_KEY})
    return h.hexdigest()


def embed_digest(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``checkpoint`` carrying its own digest under :data:`INTEGRITY_KEY` (one pass over the
    tensors)."""
    return {**checkpoint, INTEGRITY_KEY: {"algorithm": ALGORITHM, "version": MANIFEST_VERSION,
                                          "digest": content_digest(checkpoint)}}


def verify_loaded(checkpoint: Any, source: str | os.PathLike[str]) -> VerifyResult:
    """Check a single-file checkpoint already read with the restricted loader against its embedded digest."""
    if not isinstance(checkpoint, Mapping):
        return VerifyResult(
            VerifyStatus.CORRUPT,
            f"{source} is not a checkpoint: it holds a {type(checkpoint).__name__}, not a dict",
        )
    record = checkpoint.get(INTEGRITY_KEY)
    if record is None:
        return VerifyResult(
            VerifyStatus.NO_MANIFEST,
            f"{source}: no integrity digest ({INTEGRITY_KEY}); written by an older "
            "version or another tool (e.g. Lightning's own strategies), so it cannot be verified",
        )
    if not isinstance(record, Mapping) or record.get("algorithm") != ALGORITHM or "digest" not in record:
        return VerifyResult(
            VerifyStatus.CORRUPT,
            f"checkpoint {source} is corrupted: unreadable integrity record. {FIX_CORRUPT}",
        )
    if content_digest(checkpoint) != record["digest"]:
        return VerifyResult(VerifyStatus.CORRUPT,
                            f"checkpoint {source} is corrupted: {ALGORITHM} of its contents does not match "
                            f"the digest written with it. {FIX_CORRUPT}", ("contents: digest mismatch",))
    return VerifyResult(VerifyStatus.OK, f"{source}: contents match the embedded digest ({ALGORITHM})")
