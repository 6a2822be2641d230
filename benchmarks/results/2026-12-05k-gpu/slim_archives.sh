#!/usr/bin/env bash
# Repack each committed run archive without its trace.json files, where `disagg trace RUN_DIR`
# writes every one of them again byte for byte; otherwise leave the archive as it is.
set -u
cd /work/main
for A in $(git ls-files 'benchmarks/results/*.tar.xz'); do
  T=$(mktemp -d); tar -xJf "$A" -C "$T" || { echo "$A: cannot extract"; rm -rf "$T"; continue; }
  n=0; bad=0
  while IFS= read -r -d '' f; do
    d=$(dirname "$f"); n=$((n+1))
    mv "$f" "$f.orig"
    if .venv/bin/disagg trace "$d" > /dev/null 2>&1 && cmp -s "$f.orig" "$f"; then rm -f "$f" "$f.orig"; else bad=$((bad+1)); rm -f "$f"; mv "$f.orig" "$f"; fi
  done < <(find "$T" -name trace.json -print0)
  if [ "$n" = 0 ]; then echo "$A: no trace.json"; rm -rf "$T"; continue; fi
  if [ "$bad" != 0 ]; then echo "$A: $bad of $n traces not written again identically: kept as it is"; rm -rf "$T"; continue; fi
  before=$(stat -c %s "$A")
  (cd "$T" && tar -cf - $(ls -A) | xz -9e > "$T.new") && mv "$T.new" "$A"
  echo "$A: $n traces dropped, $before -> $(stat -c %s "$A") bytes"
  rm -rf "$T"
done
