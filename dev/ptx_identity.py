"""Compare the PTX of every kernel entry between two commits, entry by entry: the proof that a
restructuring left the kept kernels' code byte for byte as it was.

    python3 -S dev/ptx_identity.py BASE [HEAD]        (HEAD: the working tree)

Each tree is exported (git archive), its kernel families (pydflash.ops.FAMILIES, and dev/'s
FAMILIES where the tree has them) are compiled by NVRTC for sm_90 (the arch-specific ones for
sm_90a) with that tree's own defines, and each `.entry` function's text is compared (label
numbers, which follow the entry's place in its module, aside). Prints, for the package's entries
and for dev/'s, those identical, changed, gone and new; a package entry gone to dev/ (a variant
moved out of the package) is compared with its dev/ copy, and a dev/ entry promoted into the
package with its package copy. Exits 1 when an entry present in both trees (or moved) differs.
No GPU needed.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import tempfile
from pathlib import Path

DUMP = r"""
import json, os, re, sys
import pydflash  # the exported tree's (python -S: no editable install's import hook)
here = os.path.realpath(os.getcwd())
assert os.path.realpath(pydflash.__file__).startswith(here), pydflash.__file__
try:
    from pydflash.device import kernels
except ImportError:
    from pydflash import kernels
from pydflash import ops
fams = getattr(ops, "FAMILIES")
if callable(fams):
    fams = fams()
try:
    import dev  # the tree's dev/ variants, where it has them
    assert os.path.realpath(dev.__file__).startswith(here), dev.__file__
    dev_fams = getattr(dev, "FAMILIES", ())
except ImportError:
    dev_fams = ()
out = {"package": {}, "dev": {}}
entry = re.compile(r"^\.(?:visible|weak) \.entry (\w+)\(.*?^}\s*$", re.M | re.S)
for where, group in (("package", fams), ("dev", dev_fams)):
    for fam in group:
        arch = "sm_90a" if fam.arch_specific else "sm_90"
        folder = getattr(fam, "directory", None)
        kw = {"directory": folder} if folder is not None else {}
        ptx = kernels.compile_for_arch(fam.module, arch, fam.options, ptx=True, **kw).decode()
        for m in entry.finditer(ptx):
            # labels carry the function's index in its module ($L__BB<i>_<block>): removing an
            # earlier entry renumbers them, nothing else; the module's last entry ends with the
            # file's trailing blank lines
            text = re.sub(r"\$L__BB\d+_", "$L__BB_", m.group(0)).rstrip()
            out[where].setdefault(fam.module, {})[m.group(1)] = text
json.dump(out, sys.stdout)
"""


def dump(tree: Path) -> dict[str, dict[str, dict[str, str]]]:
    # -S: site-packages joins the path as a plain folder, its .pth files (an editable install
    # of the working tree among them) unread
    path = os.pathsep.join([str(tree), *site.getsitepackages()])
    res = subprocess.run(
        [sys.executable, "-S", "-c", DUMP],
        cwd=tree,
        env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    if res.returncode:
        raise SystemExit(f"{tree}: {res.stderr[-2000:]}")
    return json.loads(res.stdout)


def export(ref: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def compare(b: dict[str, str], h: dict[str, str]) -> tuple[list[str], ...]:
    """(identical, changed, gone, new) entry names of base b against head h."""
    same = sorted(n for n in b if n in h and b[n] == h[n])
    changed = sorted(n for n in b if n in h and b[n] != h[n])
    return same, changed, sorted(set(b) - set(h)), sorted(set(h) - set(b))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    with tempfile.TemporaryDirectory() as tmp:
        base = dump(export(argv[0], Path(tmp) / "base"))
        head_tree = export(argv[1], Path(tmp) / "head") if len(argv) > 1 else Path.cwd()
        head = dump(head_tree)

    def flat(d: dict[str, dict[str, str]]) -> dict[str, str]:
        return {name: text for entries in d.values() for name, text in entries.items()}

    def where(d: dict[str, dict[str, str]], name: str) -> str:
        return next(module for module, entries in d.items() if name in entries)

    failed = False
    b_pkg, h_pkg = flat(base["package"]), flat(head["package"])
    b_dev, h_dev = flat(base["dev"]), flat(head["dev"])
    for label, b, h in (("package", b_pkg, h_pkg), ("dev", b_dev, h_dev)):
        same, changed, gone, new = compare(b, h)
        # an entry gone from one side to the other (a variant moved to dev/, or promoted from
        # it into the package) is compared with its copy there
        other, other_name = (h_dev, "dev") if label == "package" else (h_pkg, "package")
        moved = [n for n in gone if n in other]
        moved_changed = [n for n in moved if b[n] != other[n]]
        counts = f"{len(same)} identical, {len(changed)} changed, {len(gone)} gone, {len(new)} new"
        if moved:
            counts += (
                f" ({len(moved)} of the gone in the {other_name}: {len(moved_changed)} changed "
                "there)"
            )
        print(f"{label} entries: {counts}")
        for n in changed:
            print(f"  changed: {n}")
        for n in gone:
            if n in moved:
                state = "changed" if n in moved_changed else "identical"
                print(f"  gone: {n} (to {other_name} {where(head[other_name], n)}: PTX {state})")
            else:
                print(f"  gone: {n}")
        for n in new:
            came = n in (b_pkg if label == "dev" else b_dev)
            print(
                f"  new: {n}"
                + (f" (moved from {'the package' if label == 'dev' else 'dev/'})" if came else "")
            )
        failed |= bool(changed or moved_changed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
