"""Compare the PTX of every kernel entry between two commits, entry by entry: the proof that a
restructuring left the kept kernels' code byte for byte as it was.

    python3 dev/ptx_identity.py BASE [HEAD]        (HEAD: the working tree)

Each tree is exported (git archive), its kernel families are compiled by NVRTC for sm_90 (the
arch-specific ones for sm_90a) with that tree's own defines, and each `.entry` function's text
is compared (label numbers, which follow the entry's place in its module, aside). Prints the
entries that are identical, changed, gone and new; exits 1 when an entry present in both
differs. No GPU needed.
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
out = {}
entry = re.compile(r"^\.(?:visible|weak) \.entry (\w+)\(.*?^}\s*$", re.M | re.S)
for fam in fams:
    arch = "sm_90a" if fam.arch_specific else "sm_90"
    ptx = kernels.compile_for_arch(fam.module, arch, fam.options, ptx=True).decode()
    for m in entry.finditer(ptx):
        # labels carry the function's index in its module ($L__BB<i>_<block>): removing an
        # earlier entry renumbers them, nothing else
        text = re.sub(r"\$L__BB\d+_", "$L__BB_", m.group(0))
        out.setdefault(fam.module, {})[m.group(1)] = text
json.dump(out, sys.stdout)
"""


def dump(tree: Path) -> dict[str, dict[str, str]]:
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


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        base = dump(export(argv[0], Path(tmp) / "base"))
        head_tree = export(argv[1], Path(tmp) / "head") if len(argv) > 1 else Path.cwd()
        head = dump(head_tree)
    flat = lambda d: {name: text for entries in d.values() for name, text in entries.items()}  # noqa: E731
    b, h = flat(base), flat(head)
    same = sorted(n for n in b if n in h and b[n] == h[n])
    changed = sorted(n for n in b if n in h and b[n] != h[n])
    gone, new = sorted(set(b) - set(h)), sorted(set(h) - set(b))
    counts = f"{len(same)} identical, {len(changed)} changed, {len(gone)} gone, {len(new)} new"
    print(f"entries: {counts}")
    for label, names in (("changed", changed), ("gone", gone), ("new", new)):
        for n in names:
            print(f"  {label}: {n}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
