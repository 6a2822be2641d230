"""Compile the simulator's hot modules with mypyc, in a copy of this checkout (optional).

    python tools/compile_sim.py DIR

Copies this checkout's files (tracked, and untracked ones git does not ignore) to DIR, which
must not exist, and compiles MODULES there in place with mypyc (it comes with mypy, a dev
dependency, and needs a C compiler; about a minute on two cores). Run the simulator from DIR,
e.g. `cd DIR && python benchmarks/sim_speed.py --against /tmp/base`: Python imports a module's
compiled extension before its source. A copy, not this checkout: an extension built here would
shadow every later edit of its module's source (rebuild the copy after a change).

The pure-Python modules stay the reference, and the compiled ones must give the same tables
bit for bit (`python benchmarks/same_tables.py --against CHECKOUT` from DIR). Left out:
`core/scheduler.py` and `core/policies.py`, on which mypyc (mypy 2.4) fails (it cannot write
the signature of `DecodePriorityScheduler.__init__`, a keyword-only parameter without a default
after defaulted ones; its C for the policies' pydantic imports does not compile),
`core/messages.py` (the hw control plane checks a received message against its class's
annotations, which a compiled class does not keep), `core/metrics.py` (compiled, no measurable
gain) and the modules off the per-event path.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = [
    "disagg/sim/clock.py",
    "disagg/sim/network.py",
    "disagg/sim/transfer.py",
    "disagg/sim/cluster.py",
    "disagg/sim/costmodel.py",
    "disagg/core/messenger.py",
    "disagg/core/roles.py",
    "disagg/core/kvcache.py",
    "disagg/core/request.py",
    "disagg/core/router.py",
]
SETUP = (
    "from setuptools import setup; from mypyc.build import mypycify; "
    "setup(name='disagg-compiled', ext_modules=mypycify({modules!r}, opt_level='3'))"
)


def copy_checkout(out: Path) -> None:
    """This checkout's tracked files, and its untracked ones that git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    for name in listed.decode().split("\0"):
        src = ROOT / name
        if name and src.is_file():  # (a file deleted but not yet staged is still listed)
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="where the compiled copy goes (must not exist)")
    out = ap.parse_args().dir.resolve()
    if out.exists():
        raise SystemExit(f"{out}: exists; give a new directory")
    copy_checkout(out)
    setup = SETUP.format(modules=MODULES)
    subprocess.run([sys.executable, "-c", setup, "build_ext", "--inplace"], cwd=out, check=True)
    print(f"compiled {len(MODULES)} modules in {out}")


if __name__ == "__main__":
    main()
