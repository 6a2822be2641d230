"""A validate directory replayed with one of the shared GPU's rules forced, the others set
aside: `python force_rule.py DIR RULE` (RULE: weights, extra, rr or turns) copies DIR to
DIR-RULE and runs `disagg validate --replay` there, with the issue's tolerances, as if the
calibration had found RULE closest (disagg.validate.calibration_shares)."""

import math
import shutil
import sys
from pathlib import Path

import disagg.validate as v
from disagg.fidelity import parse_tolerances

RULES = ("weights", "extra", "rr", "turns")
if len(sys.argv) != 3 or sys.argv[2] not in RULES:
    sys.exit(f"usage: python force_rule.py DIR {'|'.join(RULES)}")
src, rule = Path(sys.argv[1]), sys.argv[2]
dst = Path(f"{src}-{rule}")
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, dst)
replay_error, fit_extra, fit_switch, fit_turns = (
    v.replay_error,
    v.fit_extra,
    v.fit_switch,
    v.fit_turns,
)


def weights_error(runs, overrides, out):  # the weights' error is the one taken in `weights/`
    if out.name == "weights" and rule != "weights":
        return math.inf
    return replay_error(runs, overrides, out)


def extra(*args):
    fitted, error, passes_s = fit_extra(*args)
    return fitted, error if rule == "extra" else math.inf, passes_s


def switch(*args):
    return fit_switch(*args) if rule == "rr" else (0.0, math.inf)


def turns(*args):
    return fit_turns(*args) if rule == "turns" else ({"switch_s": 0.0}, math.inf)


v.replay_error, v.fit_extra, v.fit_switch, v.fit_turns = weights_error, extra, switch, turns
tolerances = parse_tolerances("ttft_p50=5,ttft_p90=5,tpot_p50=3,tpot_p90=3,output_throughput=3")
report = v.replay_all(dst, tolerances, (), lambda line: None)
for miss in report.missed:
    print(f"missed: {miss}")
print(f"{len(report.verdicts) - len(report.missed)} of {len(report.verdicts)} met -> {dst}")
print((dst / "calibration" / "share.json").read_text())
