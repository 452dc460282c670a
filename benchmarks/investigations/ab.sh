#!/usr/bin/env bash
# One benchmark at two or more versions of the tree, alternating in one session (this VM's host
# speed drifts 2-3x between runs, so only figures from one session compare). Each side is a
# commit (`git archive`), a directory holding a copy of the tree, "." for the working tree (a
# copy of a tree whose git metadata lacks the newest commits, as on a lent GPU machine), or
# NAME=VALUE for the working tree with that environment variable set. Each side gets its own
# editable install; the benchmark runs ROUNDS times per side, sides in the order given in odd
# rounds and in reverse in even ones, and its output goes to OUTDIR/<tag>-<side index>-<round>.log.
#
#   bash benchmarks/investigations/ab.sh OUTDIR TAG ROUNDS SIDE SIDE... -- BENCHMARK.py ARGS...
#   e.g. bash benchmarks/investigations/ab.sh out engine 2 e67d3da . -- \
#            benchmarks/engine_bench.py --backend cuda --mechanisms auto --pages 4096 --blocks-per-job 16
#   or   bash benchmarks/investigations/ab.sh out native 2 OFFLOAD_CORE_NATIVE=0 . -- benchmarks/engine_bench.py ...
set -u -o pipefail
out=$1 tag=$2 rounds=$3
shift 3
sides=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do sides+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -rf ab && mkdir -p ab
for i in "${!sides[@]}"; do
  side=${sides[$i]}
  mkdir -p "ab/$i"
  if [ "$side" = . ] || [[ "$side" =~ ^[A-Z_][A-Z0-9_]*= ]]; then
    tar --exclude=./ab --exclude='./ab-*' --exclude=./.git --exclude='./.venv*' -c . | tar -x -C "ab/$i"
  elif [ -d "$side" ]; then
    tar --exclude=./ab --exclude='./ab-*' --exclude=./.git --exclude='./.venv*' -C "$side" -c . | tar -x -C "ab/$i"
  else
    git archive "$side" | tar -x -C "ab/$i" || { echo "ab.sh: cannot archive $side" >&2; exit 1; }
  fi
done
for r in $(seq 1 "$rounds"); do
  order=("${!sides[@]}")
  if (( r % 2 == 0 )); then  # even rounds in reverse: a place in the round favours no side
    order=(); for (( k=${#sides[@]}-1; k>=0; k-- )); do order+=("$k"); done
  fi
  for i in "${order[@]}"; do
    env=()
    [[ "${sides[$i]}" =~ ^[A-Z_][A-Z0-9_]*= ]] && env=("${sides[$i]}")
    (cd "ab/$i" && python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v WARNING | tail -1
     env "${env[@]}" python3 "$@" > "$out/$tag-$i-$r.log" 2>&1)
    echo "== $tag, side $i (${sides[$i]}), round $r"
    grep -E "^(cuda|cpu|npu|xpu) |^\| [0-9]|Error|Traceback|can.t open" "$out/$tag-$i-$r.log"
  done
done
rm -rf ab
python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v WARNING | tail -1
