"""Griffe extension used by the docs build: reads the package's docstrings as they are written.

The source docstrings use Sphinx roles (``:class:`~fsdp_strategies.strategies.fsdp2.FSDP2Strategy```,
``:mod:`...```), which mkdocstrings does not resolve and the strict build refuses: a role naming a class
rendered on this site becomes a link to it (by its public path), anything else inline code (internal
module paths move; the docs never link to them).

Nothing is added: the descriptions, types and defaults stay those of the one declaration in the source.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: Public names rendered on the site, by their last path component -> the identifier mkdocstrings gives them.
RENDERED = {
    "FSDP2Strategy": "fsdp_strategies.FSDP2Strategy",
    "HSDPStrategy": "fsdp_strategies.HSDPStrategy",
    "FTHSDPStrategy": "fsdp_strategies.FTHSDPStrategy",
    "DDPHooksStrategy": "fsdp_strategies.DDPHooksStrategy",
    "ActivationCheckpointing": "fsdp_strategies.callbacks.ActivationCheckpointing",
    "MFUMonitor": "fsdp_strategies.callbacks.MFUMonitor",
    "StragglerDetector": "fsdp_strategies.callbacks.StragglerDetector",
}

_ROLE = re.compile(r":(?:py:)?(?:class|mod|meth|func|data|attr|obj|exc):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2).strip()
    last = target.rsplit(".", 1)[-1].removesuffix("()")
    shown = last if short else target
    if last in RENDERED:
        return f"[`{shown}`][{RENDERED[last]}]"
    return f"`{shown}`"


class PublicDocstrings(griffe.Extension):
    """Rewrites the roles of every docstring once the package is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        doc = obj.docstring
        if doc is None:
            return
        doc.value = _ROLE.sub(_role, doc.value)
