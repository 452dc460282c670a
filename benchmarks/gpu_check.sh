#!/usr/bin/env bash
# Everything the cuda backend needs checked on a GPU (how docs/performance.md's H200 figures were
# made). Usage: bash benchmarks/gpu_check.sh [OUTDIR] [checks|bench|reliability|grid|faults|regions|ab|all]   (default ./gpu-check, all)
# "checks": tests, compute-sanitizer, the canonical benchmark per mechanism (about 6-7 minutes: the suite took 324 s on an H200);
# "bench": offload-core bench, benchmarks/transfer_bench.py, canonical layouts with jobs back to back,
# benchmarks/engine_bench.py (about 7 minutes);
# "reliability" (not part of "all"): the whole suite, the lifetime cases under compute-sanitizer,
# the soak on cuda, submit overhead, offload-core bench (about 6 minutes);
# "grid" (not part of "all"): auto against the forced mechanisms (benchmarks/auto_vs_best.py);
# about 10 minutes on an H200, over one call's limit: PARTS=64t,runs in one call and PARTS=1t in
# the next, then `python3 benchmarks/auto_vs_best.py grid-all-*.json` over both calls' files;
# "faults" (not part of "all"): one tensor's 4 MiB jobs RUNS times, failed jobs by mechanism (about 50 s a run);
# "regions" (not part of "all"): the region soak alone, RUNS times (about 10 s a run);
# "ab" (not part of "all"): `auto` with FILE as it is against FILE replaced by ALT (an untracked
# copy, which travels with the tree), in turn twice, over the engine's shapes (about 7 minutes),
# JOBS jobs back to back (default 64 over 64 tensors, 32 over one; JOBS=4: jobs that come few at a time):
# FILE=offload_core/queue.py ALT=queue_alt.py bash benchmarks/gpu_check.sh OUT ab
set +e
out=${1:-${OUT:-gpu-check}}
phase=${2:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v WARNING | tail -2
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$out/env.txt"
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)" | tee -a "$out/env.txt"
# The device's copy of the tree may carry older git metadata: pass COMMIT=<hash> to record the right one.
echo "commit ${COMMIT:-$(git log -1 --format='%h %s' 2>/dev/null)}" | tee -a "$out/env.txt"
if [ "$phase" = grid ]; then
  # auto against the forced mechanisms over the shapes an engine sends (about 10 minutes); each
  # row's warm-up launches until a pass has timed no launch, auto's classes decided
  # (engine_bench), as an engine's first launches do.
  # PARTS: which of the grid's parts (64t, runs, 1t; default all three), their timeouts in time
  # for an H200 (64t and runs took 360 s there together, 1t about 220)
  part() { case ",${PARTS:-64t,runs,1t}," in *",$1,"*) return 0 ;; esac; return 1; }
  grid() {
    B="python3 benchmarks/engine_bench.py --backend cuda --log-decisions --mechanisms $1"
    part 64t && timeout 300 $B --layers 32 --pages 256,4096,32768 --blocks-per-job 16,128 --jobs 64 --json "$out/grid-$2-64t.json" > "$out/grid-$2-64t.log" 2>&1
    part runs && timeout 200 $B --layers 32 --pages 1024,4096 --blocks-per-job 16,64 --jobs 64 --host-runs --json "$out/grid-$2-runs.json" > "$out/grid-$2-runs.log" 2>&1
    part 1t && timeout 150 $B --tensors 1 --pages 256,4096,65536,2097152 --job-mib 4 --jobs 32 --json "$out/grid-$2-1t-4m.json" > "$out/grid-$2-1t-4m.log" 2>&1
    part 1t && timeout 200 $B --tensors 1 --pages 1024,65536,2097152 --job-mib 256 --jobs 4 --json "$out/grid-$2-1t-256m.json" > "$out/grid-$2-1t-256m.log" 2>&1
  }
  # the SMs' clock beside the grid (a kernel of few programs runs at it), into the logs' archive
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw --format=csv -lms 100 > "$out/grid-all-clocks.log" 2>&1 &
  clocks=$!
  # auto-sm1: auto choosing by speed alone, to tell its measuring from its sparing of the SMs
  grid auto,auto-sm1,expand_staged,expand_direct,ce_batch all
  kill $clocks 2>/dev/null
  python3 benchmarks/auto_vs_best.py "$out"/grid-all-*.json | tee "$out/auto_vs_best.md"
  cp "${OFFLOAD_CORE_PROFILE_DIR:-$HOME/.cache/offload-core}"/*-tuned.json "$out/" 2>/dev/null
  # the logs (each class's decision and timed launches) as one file: few files come back from a device
  (cd "$out" && tar czf "grid-logs-$(echo "${PARTS:-all}" | tr , -).tgz" grid-all-*.log && rm -f grid-all-*.log)
  exit 0
fi
if [ "$phase" = ab ]; then
  [ -f "$FILE" ] && [ -f "$ALT" ] || { echo "ab: FILE and ALT must name files" >&2; exit 2; }
  cp "$FILE" "$out/ab-base.txt"
  for arm in base alt base alt; do
    if [ $arm = alt ]; then cp "$ALT" "$FILE"; else cp "$out/ab-base.txt" "$FILE"; fi
    python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v WARNING | tail -2
    # each run decides its own winners, as a new engine does (none saved by the other arm)
    B="env OFFLOAD_CORE_PROFILE_DIR=$(mktemp -d) python3 benchmarks/engine_bench.py --backend cuda --mechanisms auto"
    timeout 100 $B --layers 32 --pages 256,4096,32768 --blocks-per-job 16,128 --jobs "${JOBS:-64}" > "$out/ab-$arm-64t.log" 2>&1
    timeout 60 $B --tensors 1 --pages 256,4096 --job-mib 4 --jobs "${JOBS:-32}" > "$out/ab-$arm-1t.log" 2>&1
    timeout 60 $B --layers 32 --pages 1024 --blocks-per-job 16 --jobs "${JOBS:-64}" --host-runs > "$out/ab-$arm-runs.log" 2>&1
    logs="$out/ab-$arm-64t.log $out/ab-$arm-1t.log $out/ab-$arm-runs.log"
    echo "== $arm"; grep -h "^cuda " $logs | cut -c1-150
    cat $logs >> "$out/ab-$arm.log"; rm -f $logs
  done | tee "$out/ab.md"
  cp "$out/ab-base.txt" "$FILE"; rm -f "$out/ab-base.txt"
  exit 0
fi
if [ "$phase" = faults ]; then
  # one tensor's 256 B and 4 KiB x 1,024 jobs (where a device fault showed twice in five runs,
  # intermittently), RUNS times (default 3), each deciding its own winners: which jobs failed on
  # the device, and by which mechanism; CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1 names the kernel
  for i in $(seq 1 "${RUNS:-3}"); do
    OFFLOAD_CORE_PROFILE_DIR=$(mktemp -d) timeout 150 python3 -X faulthandler benchmarks/engine_bench.py \
      --backend cuda --log-decisions --mechanisms auto,auto-sm1,expand_staged,expand_direct,ce_batch \
      --tensors 1 --pages 256,4096 --job-mib 4 --jobs 32 > "$out/faults-$i.log" 2>&1
    echo "run $i rc=$? failed jobs: $(grep -c 'failed on the device' "$out/faults-$i.log")"
    grep -m3 -E "failed on the device|Fatal Python error|Segmentation" "$out/faults-$i.log"
  done | tee "$out/faults.md"
  (cd "$out" && tar czf faults-logs.tgz faults-*.log && rm -f faults-*.log)
  exit 0
fi
if [ "$phase" = regions ]; then
  # the region soak alone, RUNS times (default 12): which runs left their file behind, and how
  # long it stayed locked after the last process closed it (freed_after_s); best right after
  # "checks", as the runs that left files behind so far followed heavy GPU work
  for i in $(seq 1 "${RUNS:-12}"); do
    timeout 60 python3 benchmarks/soak.py --backend cpu --rounds 1 --region-cycles 20 --seed "$i" > "$out/regions-$i.json" 2>&1
    echo "run $i rc=$? $(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['regions']; print(r['left_behind'], r['freed_after_s'], r['holders'])" "$out/regions-$i.json" 2>&1 | tail -1)"
  done | tee "$out/regions.log"
  rm -f "$out"/regions-*.json
  exit 0
fi
if [ "$phase" = reliability ]; then
  echo "== tests (whole suite)"
  timeout 450 python3 -m pytest -q -p no:cacheprovider tests > "$out/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -1 "$out/pytest.log"; grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head
  echo "== sanitizer (lifetime cases, pinned memory)"
  for c in dropped_worker dropped_worker_off_main_thread shutdown_racing_submits; do
    timeout 100 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/lifetime_cases.py $c cuda > "$out/case.log" 2>&1
    echo "$c rc=$?"; tail -1 "$out/case.log"; cat "$out/case.log" >> "$out/sanitizer.log"
  done
  echo "== soak (cuda)"; timeout 90 python3 benchmarks/soak.py --backend cuda --rounds 100 --region-cycles 20 > "$out/soak-cuda.json" 2>&1; tail -40 "$out/soak-cuda.json"
  echo "== submit overhead"; timeout 60 python3 benchmarks/submit_overhead.py --json "$out/submit.json"
  echo "== bench"; timeout 60 python3 -m offload_core bench --blocks 256 --blocks-per-job 64 --json > "$out/bench.json" 2>&1; cat "$out/bench.json"
  rm -f "$out/case.log"
  exit 0
fi
if [ "$phase" != bench ]; then
  echo "== tests"
  timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_conformance.py tests/test_worker.py \
      tests/test_cli.py tests/test_queue.py tests/test_canonical.py tests/test_cuda_host.py tests/test_cuda_driver.py tests/test_cuda_launch.py tests/test_coalesce.py \
      tests/test_threads.py tests/test_vllm_convert.py tests/test_cuda_tuning.py \
      tests/test_interrupts.py tests/test_cuda_interrupts.py tests/test_benchmarks.py > "$out/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -1 "$out/pytest.log"; grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head
  echo "== sanitizer"
  # Device backtraces only: for host ones the sanitizer keeps the Python frames of the launch
  # that loaded each kernel, with their locals, so a region whose view was on that stack never closes.
  timeout 200 compute-sanitizer --tool memcheck --show-backtrace device --error-exitcode 3 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
      -k "compact or larger_than_a_staging or block_tables" > "$out/sanitizer.log" 2>&1
  echo "sanitizer rc=$?"; tail -2 "$out/sanitizer.log"
  echo "== canonical"
  # its own winners, from its own few jobs, not those an earlier run saved for the same shapes
  env OFFLOAD_CORE_PROFILE_DIR="$(mktemp -d)" timeout 150 python3 benchmarks/canonical_bench.py --backend cuda \
      --mechanisms ce_batch,expand_staged,expand_direct,auto \
      --json "$out/canonical.json" > "$out/canonical.md" 2>&1
  tail -36 "$out/canonical.md"
fi
if [ "$phase" != checks ]; then
  echo "== bench"; timeout 60 python3 -m offload_core bench --blocks 256 --blocks-per-job 64 --json > "$out/bench.json" 2>&1; cat "$out/bench.json"
  echo "== transfer"; timeout 400 python3 benchmarks/transfer_bench.py --out "$out" > "$out/transfer.log" 2>&1; tail -3 "$out/transfer.log"
  echo "== canonical, jobs back to back"; env OFFLOAD_CORE_PROFILE_DIR="$(mktemp -d)" timeout 150 python3 benchmarks/canonical_bench.py --backend cuda --mechanisms auto \
      --heads 128,256,1024 --blocks 1024 --json "$out/canonical-1024.json" > "$out/canonical-1024.md" 2>&1; tail -6 "$out/canonical-1024.md"
  echo "== engine"; timeout 300 python3 benchmarks/engine_bench.py --backend cuda --mechanisms auto,expand_staged,expand_direct,ce_batch \
      --pages 256,4096,32768 --blocks-per-job 16,64 --jobs 128 --json "$out/engine.json" > "$out/engine.log" 2>&1; tail -24 "$out/engine.log"
fi
