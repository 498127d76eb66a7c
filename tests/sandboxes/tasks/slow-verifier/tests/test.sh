#!/bin/bash
# A verifier that hangs (and leaves a child behind): must be reported as a timeout, not reward 0.
sleep 60 &
sleep 60
echo 1 > /logs/verifier/reward.txt
