#!/usr/bin/env bash
# engine_bench.py at two commits, alternating in one session (this VM's host speed drifts 2-3x
# between runs, so only figures from one session compare). Each side is a `git archive` of its
# commit with its own editable install, run ROUNDS times, old then new.
#
#   bash benchmarks/investigations/engine_ab.sh OLD NEW OUTDIR [ROUNDS] -- ENGINE_BENCH_ARGS...
#   e.g. bash benchmarks/investigations/engine_ab.sh e67d3da HEAD out 2 -- --pages 4096 --blocks-per-job 16 --jobs 128
set -u
old=$1 new=$2 out=$3 rounds=${4:-2}
shift 4
[ "${1:-}" = "--" ] && shift
mkdir -p "$out" ab
for side in old new; do
  rm -rf "ab/$side" && mkdir -p "ab/$side"
  git archive "$([ $side = old ] && echo "$old" || echo "$new")" | tar -x -C "ab/$side"
done
for r in $(seq 1 "$rounds"); do
  for side in old new; do
    (cd "ab/$side" && python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v WARNING | tail -1
     python3 benchmarks/engine_bench.py --backend cuda --mechanisms auto "$@" --json "../../$out/engine-$side-$r.json" \
       > "../../$out/engine-$side-$r.log" 2>&1)
    echo "== $side round $r ($( [ $side = old ] && echo "$old" || echo "$new"))"; grep -E "^cuda|Error|Traceback" "$out/engine-$side-$r.log"
  done
done
rm -rf ab
python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v WARNING | tail -1
