#!/usr/bin/env bash
# The jobs' Python in the SLURM tests (APRIEL_PYTHON): runs $APRIEL_TEST_PYTHON, but holds a step
# the test armed in $APRIEL_TEST_HOLDS, so that the test can signal the job at that very moment:
#   prepare.arm: the next prepare step writes prepare.held and waits for prepare.go;
#   save.arm:    the next trainer (one rank of it) holds its first checkpoint save, with Megatron's
#                file writers running, until that writer receives SIGTERM (tests/slurm/hold_save.py).
# Each arm file is taken once (renamed atomically, so one rank or step takes it).
set -euo pipefail
H=${APRIEL_TEST_HOLDS:?the test sets APRIEL_TEST_HOLDS}
case " $* " in
  *" -m megatron_apriel.entrypoints.job_step prepare "*)
    if mv "$H/prepare.arm" "$H/prepare.taken" 2>/dev/null; then
      touch "$H/prepare.held"
      while [[ ! -e "$H/prepare.go" ]]; do sleep 0.2; done
    fi ;;
  *" -m megatron_apriel.entrypoints.trainer_rank "*)
    if mv "$H/save.arm" "$H/save.taken.$$" 2>/dev/null; then
      shift 2
      exec "$APRIEL_TEST_PYTHON" -m tests.slurm.hold_save "$@"
    fi ;;
esac
exec "$APRIEL_TEST_PYTHON" "$@"
