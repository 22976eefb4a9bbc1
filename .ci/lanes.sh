# Sourced by .ci/run: runs the engine lanes in the background and waits for them (tests/test_ci_lanes.py).
# The SGLang lane, the vLLM lane's engines part and its late part (its benchmark scripts' tests, its refused KV-cache
# start, the distillation guide's SLURM job and the transformers engine's suite with the lane's transformers, about
# eight minutes beside the others) all start at once: much of each lane is waiting on its engines' processes, and
# three parts side by side keep the two cores busier, to the end, than two.
# Each part logs to $DASKGEN_CI_CACHE/logs/LOG.log, shown when it ends.  Needs: the associative
# array lane_pid (the cleanup trap kills what is in it), $start (the run's start, for the times shown).  Sets
# lanes_failed: "LOG (exit N)" for each part that failed.
declare -A lane_rc=()
start_lane() {  # LOG NAME [VAR=VALUE...]: .ci/NAME-lane in the background, logged to $DASKGEN_CI_CACHE/logs/LOG.log
  local log=$1 name=$2
  shift 2
  echo "::: $log started"
  rm -f "$DASKGEN_CI_CACHE/logs/$log.status"
  # the part's status goes to LOG.status when it ends (bash's `wait -n` misses a part that ended while another's log
  # was being shown); setsid makes it a process group of its own, which the cleanup trap can stop whole
  env "$@" setsid bash -c '".ci/$0-lane"; echo $? >"$1.status"' "$name" "$DASKGEN_CI_CACHE/logs/$log" \
    >"$DASKGEN_CI_CACHE/logs/$log.log" 2>&1 &
  lane_pid[$log]=$!
}
lane_ended() {  # wait for the next part to end; record its status and show its log
  local log
  while :; do
    for log in "${!lane_pid[@]}"; do
      [ -s "$DASKGEN_CI_CACHE/logs/$log.status" ] || continue
      wait "${lane_pid[$log]}" || true
      unset "lane_pid[$log]"
      lane_rc[$log]=$(<"$DASKGEN_CI_CACHE/logs/$log.status")
      echo "::: $log ended at $(( $(date +%s) - start )) s (exit ${lane_rc[$log]})"
      sed "s/^/[$log] /" "$DASKGEN_CI_CACHE/logs/$log.log"
      return
    done
    sleep 1
  done
}
run_engine_lanes() {  # every lane of .ci/ that exists, to the end
  local log
  [ ! -x .ci/sglang-lane ] || start_lane sglang-lane sglang
  if [ -x .ci/vllm-lane ]; then
    start_lane vllm-lane vllm DASKGEN_VLLM_PART=engines
    start_lane vllm-late vllm DASKGEN_VLLM_PART=late
  fi
  while [ "${#lane_pid[@]}" -gt 0 ]; do lane_ended; done
  lanes_failed=()
  for log in "${!lane_rc[@]}"; do
    [ "${lane_rc[$log]}" -eq 0 ] || lanes_failed+=("$log (exit ${lane_rc[$log]})")
  done
}
