"""Missing, unexpected and reshaped keys between a state dict and the model it goes into: one diagnosis.

Four loaders compare keys before they copy anything: a resume
(:mod:`~fsdp_strategies.checkpoint.load_into_fsdp`), a pretrained folder
(:mod:`fsdp_strategies.hf.pretrained`), an export as a Hugging Face model (:mod:`fsdp_strategies.hf.export`)
and a healed state (:mod:`fsdp_strategies.ft.heal_state`). Why one implementation: the same difference should
read the same wherever it is found -- what is missing from the source, what the source has that the target
lacks, which shapes differ (source vs target), each list cut to its first names and a count
(:func:`fsdp_strategies._options.listing`) -- and one ``except StateMismatchError`` should catch all four.
Each loader keeps its own error class (a subclass of :class:`StateMismatchError`), since tests, the CLI and
users catch those; each adds its own fix to the message, since only it knows the option.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fsdp_strategies._options import listing

__all__ = ["KeyMismatch", "Shape", "StateMismatchError"]

Shape = tuple[int, ...]


class StateMismatchError(ValueError):
    """A state dict's keys or shapes do not match the model it is loaded into: the message names them and
    the fix.

    The base of every loader's mismatch error (``CheckpointMismatchError``, ``PretrainedMismatchError``, the
    HF export's and the heal's); a ``ValueError``, as each of them was."""


def _shapes(keys: Mapping[str, Shape | None] | Iterable[str]) -> Mapping[str, Shape | None]:
    return keys if isinstance(keys, Mapping) else dict.fromkeys(keys)


@dataclass(frozen=True)
class KeyMismatch:
    """What differs between a source (a checkpoint, a file, a peer's state) and the target it is loaded into.

    ``reshaped`` holds ``(key, shape in the source, shape in the target)``. Lists keep the order they are
    given in (:meth:`between` sorts them), so a caller may list keys in the model's own order."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    reshaped: tuple[tuple[str, Shape, Shape], ...] = ()

    @classmethod
    def between(cls, expected: Mapping[str, Shape | None] | Iterable[str],
                found: Mapping[str, Shape | None] | Iterable[str], *, strict: bool = True) -> KeyMismatch:
        """Compare the target's keys (``expected``; with shapes, or ``None`` where a shape is not compared)
        with the source's (``found``). ``strict=False``: keys only the source has are not a mismatch."""
        want, have = _shapes(expected), _shapes(found)
        reshaped = [(k, tuple(have[k]), tuple(want[k]))  # type: ignore[arg-type]
                    for k in sorted(set(want) & set(have))
                    if want[k] is not None and have[k] is not None and want[k] != have[k]]
        return cls(missing=tuple(sorted(set(want) - set(have))),
                   unexpected=tuple(sorted(set(have) - set(want))) if strict else (),
                   reshaped=tuple(reshaped))

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.reshaped)

    def problems(self, source: str = "checkpoint", target: str = "model", shown: int = 8) -> list[str]:
        """One phrase per kind of difference, each naming the first ``shown`` keys and how many more."""
        out = []
        if self.missing:
            out.append(f"missing in the {source}: {listing(self.missing, shown)}")
        if self.unexpected:
            out.append(f"in the {source} but not in the {target}: {listing(self.unexpected, shown)}")
        if self.reshaped:
            entries = (f"{k} {source} {list(a)} vs {target} {list(b)}" for k, a, b in self.reshaped)
            out.append(f"shape differs: {listing(entries, shown)}")
        return out

    def describe(self, source: str = "checkpoint", target: str = "model", shown: int = 8) -> str:
        """:meth:`problems` as one clause for a message (``"; "`` between them)."""
        return "; ".join(self.problems(source, target, shown))
