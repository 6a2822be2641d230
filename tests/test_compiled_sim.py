"""The optional mypyc build (`tools/compile_sim.py`) gives the pure-Python simulator's tables,
bit for bit, from compiled modules."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
WHERE = "import json, disagg.sim.cluster as c, disagg.core.messenger as m; "
WHERE += "print(json.dumps([c.__file__, m.__file__]))"


def _run(code: Path, out: Path) -> list[str]:
    """One minute of r1-disagg-1p3d simulated by `disagg sim run` with the `disagg` of `code`,
    into `out`; the files its cluster and messenger modules are imported from."""
    env = os.environ | {"PYTHONPATH": str(code)}
    cmd = [sys.executable, "-m", "disagg.cli", "sim", "run", "experiments/r1-disagg-1p3d.toml"]
    cmd += ["--set", "workload.duration_s=60", "--out", str(out), "--quiet"]
    done = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-1000:]
    where = subprocess.run(
        [sys.executable, "-c", WHERE], cwd=code, env=env, capture_output=True, text=True
    )
    files: list[str] = json.loads(where.stdout)
    return files


@pytest.mark.skipif(shutil.which("cc") is None, reason="mypyc needs a C compiler (cc)")
@pytest.mark.skipif(importlib.util.find_spec("mypyc") is None, reason="needs mypyc (mypy)")
def test_the_compiled_simulator_gives_the_pure_python_tables(tmp_path: Path) -> None:
    copy = tmp_path / "compiled"
    built = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "compile_sim.py"), str(copy)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    compiled = _run(copy, tmp_path / "from-compiled")
    source = _run(ROOT, tmp_path / "from-source")
    assert all(Path(f).suffix == ".so" for f in compiled)  # extension modules, not sources
    assert all(Path(f).suffix == ".py" for f in source)
    for table in ("requests", "steps"):
        a = pd.read_parquet(tmp_path / "from-compiled" / f"{table}.parquet")
        b = pd.read_parquet(tmp_path / "from-source" / f"{table}.parquet")
        assert len(a) > 100
        pd.testing.assert_frame_equal(a, b, check_exact=True)
