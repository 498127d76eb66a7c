#!/bin/bash
# Harbor verifier: reward 1 when answer.txt holds the sum of the two numbers in input.txt.
set -u
mkdir -p /logs/verifier
read -r a b < /app/input.txt
expected=$((a + b))
got=$(tr -d '[:space:]' < "${ANSWER_FILE}" 2>/dev/null || true)
if [ "$got" = "$expected" ] && [ -f /app/data/seed.txt ] && [ "${TASK_NAME:-}" = "hello-sum" ]; then
  echo "PASS: $got" && echo 1 > /logs/verifier/reward.txt
else
  echo "FAIL: expected $expected, got '$got'" && echo 0 > /logs/verifier/reward.txt
fi
