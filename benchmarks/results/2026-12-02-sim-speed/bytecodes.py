"""Python bytecodes the simulation executes per finished request, counted by tracing every
opcode (`sys.settrace` with `f_trace_opcodes`): deterministic, and by function, which wall time
and valgrind's totals are not. Runs `r1-disagg-1p3d` to 600 simulated s untraced, then traces
600 to 1,200 s (the steady state: plans and loads are cached by then), and prints the
bytecodes per request finished meanwhile, by file and by function (the top N).

    python benchmarks/results/2026-12-02-sim-speed/bytecodes.py DIR [N]
"""

import collections
import gc
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    code_dir = str(Path(sys.argv[1]).resolve())
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    sys.path.insert(0, code_dir)
    from disagg.config import load_experiment
    from disagg.sim.cluster import Sim

    toml = ROOT / "experiments" / "r1-disagg-1p3d.toml"
    sim = Sim(load_experiment(toml, ["workload.duration_s=1500"]))
    gc.freeze()
    sim.env.run(until=600)
    finished = sim.finished
    counts: collections.Counter[tuple[str, int, str]] = collections.Counter()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        code = frame.f_code
        key = (code.co_filename.replace(code_dir + "/", ""), code.co_firstlineno, code.co_name)
        if code.co_filename == "<string>":  # a dataclass's generated method: name its class
            key = ("<string>", 0, f"{type(frame.f_locals.get('self')).__name__}.{code.co_name}")

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                counts[key] += 1
            return local

        return local

    sys.settrace(trace)
    sim.env.run(until=1200)
    sys.settrace(None)
    n = sim.finished - finished
    print(f"{code_dir}: {sum(counts.values()) / n:,.0f} bytecodes per request ({n} finished)")
    by_file: collections.Counter[str] = collections.Counter()
    for (path, _, _), v in counts.items():
        by_file[Path(path).name] += v
    for name, v in by_file.most_common(15):
        print(f"{v / n:9.1f}  {name}")
    for (path, line, name), v in counts.most_common(top):
        print(f"{v / n:9.1f}  {Path(path).name}:{line} {name}")


if __name__ == "__main__":
    main()
