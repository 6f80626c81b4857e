#!/usr/bin/env bash
# Runs bench_pool's single-thread 4 KiB pair loop in 1, 2, 4, 8 and 16 separate processes at
# once, each pinned to a CPU of its own, and prints the total rate and its scaling. Processes
# share no memory, so this is the scaling the machine gives the pool's code with nothing shared:
# the ceiling for the in-process figure of bench_pool section 3.
#
#   scripts/scaling-processes.sh BENCH_POOL [seconds] [cpu list, e.g. "0 2 4 6 8 10 12 14 1 3 ..."]
set -euo pipefail
bin=$1
secs=${2:-1}
read -r -a cpus <<<"${3:-$(seq -s ' ' 0 $(($(nproc) - 1)))}"
one=""
printf '%10s %14s %10s %s\n' processes "M pairs/s" scaling "per process"
for n in 1 2 4 8 16; do
  [ "$n" -le "${#cpus[@]}" ] || break
  start=$(($(date +%s%3N) + 3000))  # time for every process to make its context and pool
  pids=()
  tmp=$(mktemp -d)
  for ((i = 0; i < n; i++)); do
    "$bin" --solo "${cpus[$i]}" "$start" "$secs" >"$tmp/$i" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  rates=$(cat "$tmp"/* | sed -n 's/.*: \([0-9.]*\) million.*/\1/p' | tr '\n' ' ')
  total=$(echo "$rates" | awk '{s=0; for(i=1;i<=NF;i++) s+=$i; print s}')
  [ -n "$one" ] || one=$total
  printf '%10d %14.2f %9.2fx %s\n' "$n" "$total" "$(echo "$total $one" | awk '{print $1/$2}')" "$rates"
  rm -rf "$tmp"
done
