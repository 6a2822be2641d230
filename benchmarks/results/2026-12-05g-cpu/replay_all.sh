#!/bin/bash
# usage: rep.sh TAG  -> replays every committed validate, writes /tmp/rep/TAG.txt
TAG=$1; R=/work/main/benchmarks/results; OUTF=/tmp/rep/$TAG.txt; : > $OUTF
for t in $(find $R -name runs.tar.xz | sort | grep -E "${ONLY:-.}"); do
  name=$(echo $t | sed "s|$R/||; s|/runs.tar.xz||; s|/|_|")
  d=/tmp/rep/src/$name
  [ -d $d ] || { mkdir -p $d && tar xJf $t -C $d; }
  for v in $(find $d -maxdepth 2 -name profile.csv -printf '%h\n' | sort); do
    w=/tmp/rep/$TAG/$name/$(basename $v); mkdir -p $(dirname $w); rm -rf $w; cp -r $v $w
    res=$(cd ${WT:-/work/main} && PYTHONPATH=${WT:-/work/main} /work/main/.venv/bin/python -m disagg.cli validate --replay --out $w --tolerance ttft_p50=5,ttft_p90=5,tpot_p50=3,tpot_p90=3,output_throughput=3 2>&1 | grep -E "^shared GPU|cells met|^serving loop|^Error|rror" | tr '\n' ' ')
    echo "$name $(basename $v): $res" >> $OUTF
  done
done
echo done >> $OUTF
