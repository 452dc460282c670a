#!/usr/bin/env bash
# One benchmark at two commits, alternating in one session (this VM's host speed drifts 2-3x
# between runs, so only figures from one session compare). Each side is a `git archive` of its
# commit with its own editable install; the benchmark runs ROUNDS times per side, old then new,
# and its output goes to OUTDIR/<tag>-<side>-<round>.log. NEW may be "." for the working tree (a
# copy of a tree whose git metadata lacks the newest commits, as on a lent GPU machine).
#
#   bash benchmarks/investigations/ab.sh OLD NEW OUTDIR TAG ROUNDS -- BENCHMARK.py ARGS...
#   e.g. bash benchmarks/investigations/ab.sh e67d3da HEAD out engine 2 -- \
#            benchmarks/engine_bench.py --backend cuda --mechanisms auto --pages 4096 --blocks-per-job 16
set -u
old=$1 new=$2 out=$3 tag=$4 rounds=$5
shift 5
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -rf ab && mkdir -p ab/old ab/new
git archive "$old" | tar -x -C ab/old
if [ "$new" = . ]; then
  tar --exclude=./ab --exclude=./.git --exclude='./.venv*' -c . | tar -x -C ab/new
else
  git archive "$new" | tar -x -C ab/new
fi
for r in $(seq 1 "$rounds"); do
  for side in old new; do
    (cd "ab/$side" && python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v WARNING | tail -1
     python3 "$@" > "$out/$tag-$side-$r.log" 2>&1)
    echo "== $tag, $side ($([ $side = old ] && echo "$old" || echo "$new")), round $r"
    grep -E "^(cuda|\| [0-9])|Error|Traceback" "$out/$tag-$side-$r.log"
  done
done
rm -rf ab
python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v WARNING | tail -1
