#!/usr/bin/env bash
# `make test-all`: the fast tier, then the rest of the full tier (tests/tiers.py), and at the end each tier's wall
# time against its budget, its 15 slowest cases and its costliest modules (scripts/tier_report.py, from pytest's
# JUnit XML). Past a budget it warns; it does not fail (these machines are shared and noisy). Both tiers run even
# when the first fails; the exit status is the first failure's. Budgets in seconds: $KVAGENT_FAST_BUDGET_S (720,
# 12 min of pytest) and $KVAGENT_FULL_BUDGET_S (1500, 25 min); docs/tests.md lists them and the last measured times.
# Arguments: the Python, the full tier's -m expression (the Makefile's FULL_TIER), then what each tier's pytest gets
# besides (the Makefile passes its pytest-xdist workers).
set -uo pipefail
python=${1:-python}
full=${2:?the full tier's -m expression (see the Makefile's FULL_TIER)}
shift 2
here=$(dirname "$0")
# $KVAGENT_TIER_REPORTS: a folder to keep the tiers' JUnit XML in (fast.xml, full.xml); a temporary one otherwise
if [ -n "${KVAGENT_TIER_REPORTS:-}" ]; then
    reports=$KVAGENT_TIER_REPORTS
    mkdir -p "$reports"
else
    reports=$(mktemp -d "${TMPDIR:-/tmp}/kvagent-tiers.XXXXXX")
    trap 'rm -rf "$reports"' EXIT
fi
status=0
summary=()
for tier in fast full; do
    args=()
    [ "$tier" = full ] && args=(-m "$full")
    start=$(date +%s)
    "$python" -m pytest "$@" ${args[@]+"${args[@]}"} --junitxml="$reports/$tier.xml"
    rc=$?
    [ $rc -eq 5 ] && rc=0  # no case selected (arguments that narrow the run): nothing failed
    elapsed=$(( $(date +%s) - start ))
    summary+=("$tier $elapsed $rc")
    [ $status -eq 0 ] && [ $rc -ne 0 ] && status=$rc
    [ $rc -eq 2 ] && break  # interrupted (Ctrl-C) or a usage error: the next tier would not tell more
done
for line in "${summary[@]}"; do
    read -r tier elapsed rc <<< "$line"
    budget_var="KVAGENT_$(echo "$tier" | tr a-z A-Z)_BUDGET_S"
    "$python" "$here/tier_report.py" "$tier" "$reports/$tier.xml" --wall "$elapsed" --exit "$rc" \
        ${!budget_var:+--budget "${!budget_var}"}
done
exit $status
