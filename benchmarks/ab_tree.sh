#!/usr/bin/env bash
# `auto` of this tree against `auto` of another commit's, in turn (old, new, old, new), in one
# run on one GPU, over the engine's shapes and the one-tensor grid's: whether any row got slower.
# Usage: mkdir OLD && git archive <commit> offload_core backends benchmarks setup.py pyproject.toml README.md | tar -x -C OLD
#        bash benchmarks/ab_tree.sh OUT OLD      (OLD travels to a GPU machine as an untracked folder)
# Each tree is installed apart (pip --target) and runs its own engine_bench.py, each run from a
# fresh profile directory (as a new engine: no winners saved by the other arm). ARMS=old,new,...
# sets the order; an arm starts only while fewer than BUDGET_S (default 330) seconds have passed;
# MECHANISMS (default auto) what each arm runs, e.g. auto,ce_batch (names both trees know).
set +e
out=${1:?OUT}
old=$(cd "${2:?OLD tree}" && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
for t in new old; do
  src=.; [ $t = old ] && src=$old
  rm -rf "/tmp/site-$t"
  python3 -m pip install --no-deps --no-build-isolation -q --target "/tmp/site-$t" "$src" 2>&1 | grep -v WARNING | tail -2
  # each arm must run its own tree, not one installed elsewhere
  (cd /tmp && PYTHONPATH=/tmp/site-$t python3 -c "import offload_core, sys; sys.exit(not offload_core.__file__.startswith('/tmp/site-$t/'))") \
    || { echo "the $t tree did not install" >&2; exit 2; }
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/env.txt"
t0=$(date +%s)
for arm in $(echo "${ARMS:-old,new,old,new}" | tr , ' '); do
  [ $(( $(date +%s) - t0 )) -lt "${BUDGET_S:-330}" ] || { echo "== $arm: not started (budget)"; continue; }
  src=.; [ $arm = old ] && src=$old
  prof=$(mktemp -d)
  B="env PYTHONPATH=/tmp/site-$arm OFFLOAD_CORE_PROFILE_DIR=$prof XDG_CACHE_HOME=$prof python3 $src/benchmarks/engine_bench.py --backend cuda --mechanisms ${MECHANISMS:-auto}"
  {
    echo "== $arm"
    timeout 100 $B --layers 32 --pages 256,4096,32768 --blocks-per-job 16,128 --jobs 64
    timeout 50 $B --tensors 1 --pages 256,4096,65536,2097152 --job-mib 4 --jobs 32
    timeout 60 $B --tensors 1 --pages 1024,65536,2097152 --job-mib 256 --jobs 4
  } >> "$out/ab-tree.log" 2>&1
  grep -c "^cuda" "$out/ab-tree.log"
done
