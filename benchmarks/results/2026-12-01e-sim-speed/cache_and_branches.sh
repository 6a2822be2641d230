PYTHONHASHSEED=0 valgrind --tool=cachegrind --cache-sim=yes --branch-sim=yes --cachegrind-out-file=/dev/null /work/main/.venv/bin/python -c "
import sys; sys.path.insert(0, '$1'); from disagg.config import load_experiment
from disagg.sim.cluster import Sim
exp=load_experiment('$1/experiments/r1-disagg-1p3d.toml', ['workload.duration_s=$2'])
Sim(exp).run()" 2>&1 | grep -E "I +refs|D1  misses|LLd misses|Mispred|D +refs|I1  misses" | sed "s#^#$1 $2 #"
