#!/usr/bin/env bash
# The README's test command: set up .venv, then the whole suite in two phases: tests/unit on two
# pytest-xdist workers (one thread each: the single-process tests keep both cores busy), then the
# multi-process Megatron tests and end to end (each already uses both cores) one at a time. Beside
# both, at idle CPU priority, the tests marked `background` (nothing timed: one thread of compute,
# or a Megatron job's gloo ranks): the end-to-end phase leaves a third of the two cores idle (a
# run's steps are one process at a time), and they take that instead of ~150 s of the unit phase
# and ~90 s of the serial second phase.
#   --fast   the tier for working (4.5 min here): every file of tests/unit and tests/distributed without
#            the tests marked slow, and the one end-to-end quickstart run (marker `quickstart`).
#   other arguments go to pytest, which then runs once over the whole suite, serially.
# Each phase prints its 15 slowest tests, so growth shows in every CI log.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then fast=1; shift; fi
bash launch/setup_env.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
pytest=(.venv/bin/python -m pytest -q --durations=15)
rest=(); for d in tests/distributed tests/e2e tests/gpu; do [ -d "$d" ] && rest+=("$d"); done
select=()
if [ "$fast" = 1 ]; then
  rest=(tests/distributed tests/e2e/test_driver.py)
  select=(-m "(not slow and not e2e) or quickstart")
elif [ $# -gt 0 ]; then
  exec "${pytest[@]}" tests/unit "${rest[@]}" "$@"
fi
# The tool task's bundle (tests/conftest.py), built beside the unit phase into a folder both phases
# share: one process more on the two cores while the unit tests run, not ~70 s of the end-to-end
# phase, which runs one test at a time. Its tests wait for it (a file lock).
DAPO_TEST_BUNDLES="$(mktemp -d -t dapo-test-bundles-XXXXXX)"; export DAPO_TEST_BUNDLES
builder=""; background=""; background_log="$DAPO_TEST_BUNDLES/background.log"
trap '[ -z "$builder" ] || kill "$builder" 2>/dev/null; [ -z "$background" ] || kill "$background" 2>/dev/null
  rm -rf "$DAPO_TEST_BUNDLES"' EXIT
if [ "$fast" = 0 ]; then
  OMP_NUM_THREADS=1 .venv/bin/python -c 'import sys; from tests.conftest import build_tool_bundle; build_tool_bundle(sys.argv[1])' \
    "$DAPO_TEST_BUNDLES" & builder=$!
  # SCHED_IDLE (nice 19 where chrt cannot set it): it runs only on a core the phases leave idle
  idle=(nice -n 19); if chrt --idle 0 true 2>/dev/null; then idle=(chrt --idle 0); fi
  # pyproject's 900 s a test guards against a hang; at idle priority a test takes only what the
  # phases leave, so on a slow machine its one-core builds (the VL warm-up) ran past 900 s
  OMP_NUM_THREADS=1 "${idle[@]}" "${pytest[@]}" -p no:cacheprovider --basetemp "$DAPO_TEST_BUNDLES/background" \
    --timeout 2700 -m background tests/unit "${rest[@]}" \
    >"$background_log" 2>&1 & background=$!
  select=(-m "not background")
fi
status=0
OMP_NUM_THREADS=1 "${pytest[@]}" -n 2 tests/unit "${select[@]}" "$@" || status=$?
# a failed build is built again, and reported, by the first test that needs it
if [ -n "$builder" ]; then
  wait "$builder" || echo "the tool bundle's build failed; its tests build it again" >&2
  builder=""
fi
"${pytest[@]}" "${rest[@]}" "${select[@]}" "$@" || status=$?
if [ -n "$background" ]; then
  echo "== the tests marked background (run at idle priority beside the phases above):"
  wait "$background" || status=$?
  background=""
  cat "$background_log"
fi
exit "$status"
