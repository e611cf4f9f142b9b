#!/usr/bin/env bash
# The jobs' Python in the SLURM tests (APRIEL_PYTHON): runs $APRIEL_TEST_PYTHON, but holds a step
# the test armed in $APRIEL_TEST_HOLDS, so that the test can signal the job at that very moment:
#   prepare.arm: the next prepare step writes prepare.held and waits for prepare.go;
#   save.arm:    the next trainer (one rank of it) holds its first checkpoint save, with Megatron's
#                file writers running, until that writer receives SIGTERM (tests/slurm/hold_save.py);
#   step.arm:    every trainer rank of a run starting from scratch holds after its first step until a
#                stop request reaches it (tests/slurm/hold_step.py). Not taken: every rank, every attempt.
# prepare.arm and save.arm are taken once (renamed atomically, so one rank or step takes them).
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
    fi
    if [[ -e "$H/step.arm" ]]; then
      shift 2
      exec "$APRIEL_TEST_PYTHON" -m tests.slurm.hold_step "$@"
    fi ;;
esac
exec "$APRIEL_TEST_PYTHON" "$@"
