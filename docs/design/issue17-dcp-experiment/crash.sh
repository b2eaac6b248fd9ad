#!/bin/bash
# usage: crash.sh CRASH_RANK CRASH_AT PORT  — two ranks launched by hand (no torchrun), so the survivor's fate is visible
export PYTHONPATH=/work/main EXP_DIR=/tmp/s23/dcp/crash-$2-$1 MODE=crash CRASH_RANK=$1 CRASH_AT=$2
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$3 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 OMP_NUM_THREADS=1
rm -rf $EXP_DIR; mkdir -p $EXP_DIR
for r in 0 1; do RANK=$r LOCAL_RANK=$r timeout 90 /work/main/.venv/bin/python exp.py > $EXP_DIR/out$r.txt 2>&1 & done
wait
echo "== $2 rank$1: $(ls $EXP_DIR/crash 2>/dev/null | tr '\n' ' ')"
grep -h '^{' $EXP_DIR/out*.txt
