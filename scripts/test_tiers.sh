#!/usr/bin/env bash
# `make test-all`: the fast tier, then the rest of the full tier (`pytest -m full`), each tier's wall time printed
# at the end. Both tiers run even when the first fails; the exit status is the first failure's.
set -uo pipefail
python=${1:-python}
status=0
times=()
for tier in fast full; do
    args=()
    [ "$tier" = full ] && args=(-m full)
    start=$(date +%s)
    "$python" -m pytest "${args[@]}"
    rc=$?
    elapsed=$(( $(date +%s) - start ))
    times+=("$tier tier: $((elapsed / 60)) min $((elapsed % 60)) s (pytest exit $rc)")
    [ $status -eq 0 ] && [ $rc -ne 0 ] && status=$rc
done
printf '%s\n' "${times[@]}"
exit $status
