#!/usr/bin/env bash
echo "speedrun.sh: not written yet (issue 6: speedrun end to end). Use runs/runcpu.sh for now." >&2
exit 1
