#!/usr/bin/env bash
# Everything that needs a GPU, in one go, for a machine that has one:
#   1. builds for the GPU's own architecture (sm_90 on Hopper),
#   2. runs the whole CTest suite with STREAMALLOC_REQUIRE_GPU=1, so a GPU test that cannot
#      run fails instead of skipping; any skipped test fails this script (the packaging and
#      documentation labels, which need no GPU but tools such a machine lacks, are CI's; the
#      multigpu label, which needs two GPUs, runs only where the machine has them, and the
#      summary says whether it ran),
#   3. runs compute-sanitizer (memcheck) over every GPU test binary and example, and
#      racecheck over the pool, vmm and graph_exec tests,
#   4. runs the benches,
# then prints a summary table. Logs and bench JSON go to $OUT (or ./gpu-check-out).
#
#   scripts/gpu-check.sh [--quick | --steps LIST]
#     --quick        build and tests only (no sanitizers, no benches)
#     --steps LIST   the build, then only the steps named (comma-separated: ctest, sanitizers,
#                    bench); for machines that limit how long one command may run: the whole
#                    script takes about 16 minutes on an H200 (the build 2 to 3, ctest 3, the
#                    sanitizers 4 to 5, the benches 5 to 6), so it runs there as three calls on
#                    the same build tree, --steps ctest, --steps bench, --steps sanitizers.
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
out=${OUT:-$here/gpu-check-out}
mkdir -p "$out"
build=${BUILD_DIR:-$here/build-gpu}
steps=ctest,sanitizers,bench
case "${1:-}" in
  --quick) steps=ctest ;;
  --steps) steps=${2:?"--steps needs a list: ctest,sanitizers,bench"} ;;
  "") ;;
  *) echo "usage: $0 [--quick | --steps ctest,sanitizers,bench]" >&2; exit 2 ;;
esac
wants() { [[ ",$steps," == *",$1,"* ]]; }

declare -a summary=()
failed=0
step() {  # step <name> <command...>: runs, logs to $out/<name>.log, records the outcome
  local name=$1; shift
  local start=$SECONDS
  echo "=== $name: $*"
  if "$@" >"$out/$name.log" 2>&1; then
    summary+=("$(printf '%-28s %-6s %4ss' "$name" ok $((SECONDS - start)))")
    echo "--- $name ok, $((SECONDS - start)) s"  # as it happens: a run cut off still shows how far it got
  else
    summary+=("$(printf '%-28s %-6s %4ss  (see %s.log)' "$name" FAILED $((SECONDS - start)) "$name")")
    failed=1
    tail -n 40 "$out/$name.log"
  fi
}

nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader | tee "$out/gpu.txt"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
# The multigpu tests (peer access) need two GPUs: excluded, and said so, on a machine with one,
# rather than skipped (a skip fails this script).
if [ "$gpus" -ge 2 ]; then
  multigpu_note="multigpu: run ($gpus GPUs)"
  exclude='^(conan|vcpkg|docs)$'
else
  multigpu_note="multigpu: NOT run (this machine has $gpus GPU; they need 2)"
  exclude='^(conan|vcpkg|docs|multigpu)$'
fi
echo "$multigpu_note"
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' .')
arch=${arch:-90}
doctest_dir=""
[ -f "$here/.deps/doctest/doctest/doctest.h" ] && doctest_dir="-DSTREAMALLOC_DOCTEST_DIR=$here/.deps/doctest"
generator=""
command -v ninja >/dev/null && generator="-G Ninja"

build_all() {
  # Every option explicitly: a build tree left from an earlier run may have cached others.
  cmake -S . -B "$build" $generator -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DSTREAMALLOC_BUILD_TESTS=ON -DSTREAMALLOC_BUILD_EXAMPLES=ON \
    -DSTREAMALLOC_BUILD_BENCH=ON $doctest_dir && cmake --build "$build" -j "$(nproc)"
}
step build build_all

export STREAMALLOC_REQUIRE_GPU=1
run_ctest() {
  local log
  log=$(mktemp)
  (cd "$build" && ctest --output-on-failure -j 4 "$@") 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  if grep -q "The following tests did not run" "$log"; then
    echo "some tests were skipped; on a GPU machine nothing may be"
    rc=1
  fi
  if ! grep -qE "tests passed.* out of [1-9]" "$log"; then
    echo "no tests ran"
    rc=1
  fi
  rm -f "$log"
  return "$rc"
}
# Every test but the packaging and documentation ones, which need tools a GPU machine lacks and
# no GPU: CI runs them (conan: Conan from PyPI; docs: doxygen), and vcpkg's wherever VCPKG_ROOT
# names a vcpkg (docs/installing.md).
wants ctest && step ctest run_ctest -LE "$exclude"
# Every GPU test file is in one binary (tests/CMakeLists.txt); as CTest does, each file's cases
# run in a process of their own: "$gpu_tests" --source-file="*/gpu/<name>_test.cu".
gpu_tests=$build/tests/gpu_tests
gpu_names=()
for src in "$here"/tests/gpu/*_test.cu; do gpu_names+=("$(basename "$src" _test.cu)"); done

# What the GPU tests printed (capabilities, driver answers): passing tests show no output above.
if wants ctest; then
  for name in "${gpu_names[@]}"; do
    "$gpu_tests" --source-file="*/gpu/${name}_test.cu" >>"$out/ctest.log" 2>&1
  done
fi

sanitize() {
  local rc=0 name  # name: not step's, which this runs inside
  export STREAMALLOC_STRESS_ITERATIONS=120
  # The tests provoke driver errors on purpose (bad descriptors, ranges past a reservation);
  # memcheck is here for memory errors, so API errors are not reported.
  local memcheck=(compute-sanitizer --tool memcheck --error-exitcode 99 --leak-check full --report-api-errors no)
  local racecheck=(compute-sanitizer --tool racecheck --error-exitcode 99 --report-api-errors no)
  for name in "${gpu_names[@]}"; do
    local args=()
    if [ "$name" = peer_access ]; then
      [ "$gpus" -ge 2 ] || continue  # it would only say it skipped
      # Without the case whose child process faults on purpose (a write through read-only
      # access): the fault is the driver's answer, not a memory error of streamalloc's.
      args=(--test-case-exclude='*a write faults*')
    fi
    if [ "$name" = nccl ] && [ "$gpus" -ge 2 ]; then
      # Without the case of one process per GPU: memcheck reports NCCL's registered all-gather
      # writing out of bounds into the peer's memory (mapped into this process by NCCL) and
      # the launch fails, with NCCL's own ncclMemAlloc buffers as with the pool's
      # (scripts/nccl-memcheck-repro.cu); without memcheck the case runs and checks every value.
      args=(--test-case-exclude='*one process per GPU*')
    fi
    echo "--- memcheck gpu_$name"
    "${memcheck[@]}" "$gpu_tests" --source-file="*/gpu/${name}_test.cu" ${args[@]+"${args[@]}"} || rc=1
  done
  for bin in "$build"/examples/streamalloc_* "$build"/examples/example_*; do
    [ -x "$bin" ] || continue
    echo "--- memcheck $(basename "$bin")"
    "${memcheck[@]}" "$bin" || rc=1
  done
  for name in pool vmm device_arena; do
    echo "--- racecheck gpu_$name"
    "${racecheck[@]}" "$gpu_tests" --source-file="*/gpu/${name}_test.cu" || rc=1
  done
  # Without its timing case: 256-kernel graphs launched thousands of times take racecheck
  # longer than any run may (the rest takes seconds).
  echo "--- racecheck gpu_graph_exec"
  "${racecheck[@]}" "$gpu_tests" --source-file='*/gpu/graph_exec_test.cu' --test-case-exclude='*as fast as*' || rc=1
  return $rc
}
wants sanitizers && step sanitizers sanitize
benches() {
  "$build/bench/bench_pool" --json "$out/pool.json" && \
  echo && echo "the same threads, one process each (scripts/scaling-processes.sh):" && \
  "$here/scripts/scaling-processes.sh" "$build/bench/bench_pool" 1 && \
  echo && echo "the same threads on the CPU, pool core on a simulated device (bench_threads_sim):" && \
  "$build/bench/bench_threads_sim" && \
  "$build/bench/bench_stream_buffer" --json "$out/stream_buffer.json" && \
  "$build/bench/bench_bandwidth" --json "$out/bandwidth.json" && \
  "$build/bench/bench_vmm_costs" && \
  "$build/bench/bench_scale" --json "$out/scale.json" && \
  echo && echo "the scale bench's ring and live blocks on the CPU, pool core on a simulated device (bench_scale_sim):" && \
  "$build/bench/bench_scale_sim" && \
  "$build/bench/bench_graphs" --json "$out/graphs.json" && \
  "$build/bench/bench_ipc" --json "$out/ipc.json" && \
  "$build/bench/bench_multigpu" --json "$out/multigpu.json" && \
  "$build/bench/bench_stream_lookup" --json "$out/stream_lookup.json" && \
  "$build/bench/bench_device_arena" --json "$out/device_arena.json" && \
  "$build/bench/bench_snapshot" --json "$out/snapshot.json" && \
  "$build/bench/bench_logging_resource" --json "$out/logging_resource.json" && \
  "$build/bench/bench_trace_replay" --traces "$here/bench/traces" --json "$out/trace_replay.json"
}
wants bench && step bench benches

echo
echo "== gpu-check summary ($(cat "$out/gpu.txt"))"
printf '%s\n' "${summary[@]}"
echo "$multigpu_note"
[ -f "$out/ctest.log" ] && { grep -E "tests passed" "$out/ctest.log" | head -n 1 || true; }
if [ -f "$out/sanitizers.log" ]; then  # the verdict of each tool run
  echo; grep -E "^--- |ERROR SUMMARY|LEAK SUMMARY|RACECHECK SUMMARY" "$out/sanitizers.log" || true
fi
if [ -f "$out/bench.log" ]; then
  echo; sed -n '/^1\. allocate/,/^wrote .*pool.json/p' "$out/bench.log"
  echo; sed -n '/^the same threads, one process each/,/^ *16 /p' "$out/bench.log"
  echo; sed -n '/^the same threads on the CPU/,/^ *16 /p' "$out/bench.log"
  echo; sed -n '/^growing a buffer/,/^wrote .*stream_buffer.json/p' "$out/bench.log"
  echo; sed -n '/^1\. hand-off ring/,/^wrote .*scale.json/p' "$out/bench.log"
  echo; sed -n '/^the scale bench.s ring and live blocks on the CPU/,/^ *1000000 /p' "$out/bench.log"
  echo; sed -n '/^1\. N blocks/,/^wrote .*graphs.json/p' "$out/bench.log"
  echo; sed -n '/^one thread, ns per call/,/^wrote .*stream_lookup.json/p' "$out/bench.log"
fi
exit $failed
