# stop 56, call 3: the fused merge staged in shared memory (branch fused-merge-smem)
export LD_LIBRARY_PATH=$PWD/devbin; for f in devbin/*.xz; do xz -dkf $f; done; chmod +x devbin/*
{ nvidia-smi --query-gpu=name --format=csv; timeout 150 devbin/cuda_tests 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 12000; echo "tests exit ${PIPESTATUS[0]}"
  KVSLIM_CUDA_FUSED_MERGE=1 timeout 90 devbin/cuda_tests --gtest_filter='CudaStepGraph.*:CudaEviction.*:CudaAttend.*:CudaZipcache.*:-CudaStepGraph.*LargerStores' 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 6000; echo "fused merge tests exit ${PIPESTATUS[0]}"; } > $OUT/tests.txt 2>&1
A="bench attend --device cuda --batch 1 8 --context 32768 --head-dim 128 --cache full kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache"
for r in 1 2; do for cfg in "main 0" "kvslim 0" "kvslim 1"; do set -- $cfg; b=$1; [ $b = main ] && b=kvslim_main; echo "=== $b fused=$2 run $r"; KVSLIM_CUDA_FUSED_MERGE=$2 timeout 60 devbin/$b $A 2>&1 | grep -E "^128"; done; done > $OUT/ab_fused.txt 2>&1
timeout 60 devbin/kvslim $A --json /tmp/a.json > /dev/null 2>&1; timeout 90 python3 bench/cuda/sdpa_bench.py --kvslim /tmp/a.json 2>&1 | grep -v "^append" >> $OUT/ab_fused.txt
{ KVSLIM_CUDA_FUSED_MERGE=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests --gtest_filter='CudaAttend.*:CudaStepGraph.*:CudaZipcache.Attention*:-CudaStepGraph.*LargerStores' 2>&1 | tail -n 8; echo "memcheck (fused) exit ${PIPESTATUS[0]}"; } >> $OUT/tests.txt 2>&1
{ KVSLIM_CUDA_FUSED_MERGE=1 timeout 120 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 devbin/cuda_tests --gtest_filter='CudaAttend.BatchWithOwnLengths*:CudaAttend.EveryKind*' 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -n 8; echo "racecheck (fused) exit ${PIPESTATUS[0]}"; } >> $OUT/tests.txt 2>&1
grep -E "exit|FAILED|ERROR SUMMARY|RACECHECK SUMMARY" $OUT/tests.txt; cat $OUT/ab_fused.txt
