"""Pack what a GPU machine's image lacks as wheels, for a machine without network access.

    python benchmarks/gpu_pack.py                  # fills .whl/ (git-ignored) and prints the install command
    python benchmarks/gpu_pack.py --image-freeze image-freeze.txt   # exact: `pip freeze` of the GPU image

The harness (``benchmarks/gpu.py``) and the example's CLI need ``torchft`` and
``jsonargparse[signatures]`` next to torch, Lightning, transformers and matplotlib. For an image that
has the latter (here: Python 3.12, CUDA torch 2.11, lightning 2.6.6, transformers, matplotlib) but
not the former, this script downloads CPython 3.12 manylinux x86_64 wheels of ``PACKAGES`` and of
every requirement the image does not provide, one wheel at a time with ``pip download --no-deps``
(so torch and the CUDA libraries are never pulled in). Requirements are read from each downloaded
wheel's own ``METADATA`` (``Requires-Dist``, markers evaluated for CPython 3.12 on x86_64 Linux).

What the image provides is, by default, the requirement closure of ``IMAGE_HAS`` as installed in
*this* environment (``--image-freeze`` replaces it with the image's exact package list). Versions are
pinned to the ones installed here when they satisfy the requirement (the combination this project is
tested with), else pip picks the newest matching release. At the end every packed requirement is
checked against the packed versions, and the one-line install-and-run command for the GPU machine is
printed::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:src && python3 benchmarks/gpu.py
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / ".whl"
PACKAGES = ("torchft==0.2.0", "jsonargparse[signatures]==4.53.0")
IMAGE_HAS = ("torch", "lightning", "transformers", "matplotlib")
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
#: never packed, whatever the closure says: the image's torch stack (shadowing it would break CUDA torch)
NEVER = {"torch", "triton", "numpy"}
INSTALL = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
    ".whl/*.whl && export PYTHONPATH=/tmp/site:src"
)
MARKER_ENV = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.0",
              "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "sys_platform": "linux",
              "platform_system": "Linux",
              "platform_machine": "x86_64", "os_name": "posix", "platform_release": "",
              "platform_version": "", "implementation_version": f"{PYTHON}.0"}


def applies(marker: Marker | None, extras: set[str]) -> bool:
    """Whether a requirement's marker holds on the GPU machine for the requested extras."""
    if marker is None:
        return True
    return any(marker.evaluate({**MARKER_ENV, "extra": e}) for e in ({""} | extras))


def installed_closure(roots: tuple[str, ...]) -> dict[str, str]:
    """Canonical name -> version of ``roots`` and everything they require, as installed here."""
    seen: dict[str, str] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        seen[name] = dist.version
        todo.extend(r for r in map(Requirement, dist.requires or []) if applies(r.marker, set(req.extras)))
    return seen


def image_from_freeze(path: Path) -> dict[str, str]:
    """``pip freeze`` / ``pip list --format=freeze`` output of the GPU image: name -> version."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[.*\])?\s*(?:==|@)\s*(\S+)?", line.strip())
        if m:
            out[canonicalize_name(m.group(1))] = (m.group(2) or "").strip()
    return out


def wheel_metadata(path: Path) -> tuple[str, str, list[Requirement]]:
    """(name, version, Requires-Dist) from a wheel's ``*.dist-info/METADATA`` (what ``unzip -p`` shows)."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    pairs = [h.split(": ", 1) for h in text.split("\n\n", 1)[0].splitlines()
             if ": " in h and not h.startswith((" ", "\t"))]
    fields = dict(reversed(pairs))  # the first Name / Version wins
    return fields["Name"], fields["Version"], [Requirement(v) for k, v in pairs if k == "Requires-Dist"]


def find_wheel(dest: Path, name: str, version: str | None = None) -> Path | None:
    for path in sorted(dest.glob("*.whl")):
        wname, wver, _, _ = parse_wheel_filename(path.name)
        if wname == canonicalize_name(name) and (version is None or wver == Version(version)):
            return path
    return None


def download(spec: str, dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           PYTHON,
           "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest),
           spec, "--quiet", "--disable-pip-version-check"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"pip download {spec} failed:\n{proc.stdout}{proc.stderr}\nFix: check the network, the "
            f"package name/version, and that a cp{PYTHON.replace('.', '')} manylinux x86_64 (or pure "
            f"Python) wheel exists for it."
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dest", type=Path, default=DEST, help="wheel folder (default .whl/, git-ignored)")
    parser.add_argument("--image-freeze", type=Path, default=None,
                        help="the GPU image's `pip freeze` output: what it provides, exactly")
    parser.add_argument("--have", nargs="*", default=[], help="more packages the image provides (names)")
    parser.add_argument(
        "--packages", nargs="+", default=list(PACKAGES), help="what to pack (requirement strings)"
    )
    ns = parser.parse_args(argv)

    if ns.image_freeze:
        image = image_from_freeze(ns.image_freeze)
        source = f"{ns.image_freeze} (exact)"
    else:
        image = installed_closure(IMAGE_HAS)
        source = (
            f"requirement closure of {', '.join(IMAGE_HAS)} as "
            "installed here (approximate; --image-freeze is exact)"
        )
    image.update({canonicalize_name(n): "" for n in ns.have})
    here = {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions()}
    dest: Path = ns.dest
    dest.mkdir(parents=True, exist_ok=True)

    # name -> version, wheel, requires, extras
    chosen: dict[str, tuple[str, Path, list[Requirement], set[str]]] = {}
    provided: dict[str, str] = {}
    queue = [(Requirement(p), "(requested)") for p in ns.packages]
    while queue:
        req, why = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in NEVER or (
            name in image and name not in {canonicalize_name(Requirement(p).name) for p in ns.packages}
        ):
            provided[name] = f"{image.get(name) or '?'} (image), needed by {why}"
            continue
        if name in chosen:
            version, wheel, requires, extras = chosen[name]
            if req.specifier and Version(version) not in req.specifier:
                raise SystemExit(
                    f"conflict: {why} needs {req}, but {name}=={version} is packed. Fix: pin a version "
                    f"that satisfies both in --packages."
                )
            new = set(req.extras) - extras
            if new:
                extras |= new
                queue.extend((r, f"{name}[{','.join(sorted(new))}]") for r in requires if applies(r.marker,
                                                                                                  new)
                             and r.marker is not None and "extra" in str(r.marker))
            continue
        pinned = here.get(name)
        spec = f"{req.name}=={pinned}" if pinned and (not req.specifier or Version(pinned) in req.specifier) \
            else f"{req.name}{req.specifier}"
        wheel = find_wheel(dest, name, pinned if spec.endswith(f"=={pinned}") else None)
        if wheel is None:
            download(spec, dest)
            wheel = find_wheel(dest, name, pinned if spec.endswith(f"=={pinned}") else None)
        if wheel is None:
            raise SystemExit(f"pip download {spec} left no wheel of {name} in {dest}.")
        wname, version, requires = wheel_metadata(wheel)
        if canonicalize_name(wname) != name:
            raise SystemExit(f"{wheel.name}: its METADATA names {wname!r}, expected {name!r}.")
        if req.specifier and Version(version) not in req.specifier:
            raise SystemExit(f"{wheel.name}: version {version} does not satisfy {req} (needed by {why}).")
        extras = set(req.extras)
        chosen[name] = (version, wheel, requires, extras)
        queue.extend((r, f"{name}=={version}") for r in requires if applies(r.marker, extras))

    keep = {w for _, w, _, _ in chosen.values()}
    stale = [p for p in dest.glob("*.whl") if p not in keep]
    for path in stale:  # `.whl/*.whl` must be exactly this set
        path.unlink()

    # consistency: every applicable requirement of every packed wheel is met by the pack or by the image
    problems = []
    for name, (version, _, requires, extras) in sorted(chosen.items()):
        for r in requires:
            if not applies(r.marker, extras):
                continue
            dep = canonicalize_name(r.name)
            if dep in chosen:
                if r.specifier and Version(chosen[dep][0]) not in r.specifier:
                    problems.append(f"{name}=={version} needs {r}, packed {dep}=={chosen[dep][0]}")
            elif dep not in provided:
                problems.append(f"{name}=={version} needs {r}: neither packed nor provided")
    print(f"packed into {dest} ({sum(w.stat().st_size for w in keep) / 2**20:.1f} MiB, {len(keep)} wheels):")
    manifest = []
    for name, (version, wheel, requires, _) in sorted(chosen.items()):
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        manifest.append(f"{wheel.name} sha256={digest}")
        reqs = ", ".join(str(r) for r in requires if applies(r.marker, chosen[name][3])) or "-"
        print(f"  {name}=={version:<14} {wheel.name}\n      Requires-Dist: {reqs}")
    print(f"assumed on the image ({source}):")
    for name, why in sorted(provided.items()):
        print(f"  {name} {why}")
    (dest / "MANIFEST.txt").write_text("\n".join(manifest) + "\n")
    if stale:
        print(f"removed {len(stale)} wheel(s) not in this set: {', '.join(p.name for p in stale)}")
    if problems:
        print("INCONSISTENT:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(
        "consistent: every requirement of every packed wheel "
        "is packed (at a matching version) or on the image."
    )
    print("\non the GPU machine (repository root, .whl/ copied along):")
    print(f"  {INSTALL} && python3 benchmarks/gpu.py")
    if shutil.which("unzip"):
        print("(check a wheel's requirements by hand: unzip -p "
              f"{next(iter(keep)).relative_to(ROOT) if keep else ''} "
              "'*.dist-info/METADATA' | grep Requires-Dist)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
