# c2: the ranked align at 128 threads (token segments by ballot): tests, sanitizer, A/B against
# cfbdc16's bench, ncu source counters of both aligns with LoRA, then every GPU test. In priority
# order: whatever the time limit cuts is last.
set -x
export MOELORA_TEST_DATA_DIR=$PWD/tests/data MOELORA_BINARY_DIR=$PB
T=$PB/tests
st() { date +%H:%M:%S; }
echo "== $(st) focused tests"
$T/gpu_moe_ops_test > $R/gpu_moe_ops_test.log 2>&1; echo "ops rc $?"
$T/gpu_moe_layer_test > $R/gpu_moe_layer_test.log 2>&1; echo "layer rc $?"
grep -h -E "^\[  (PASSED|FAILED) " $R/gpu_*.log
compute-sanitizer --tool memcheck --error-exitcode 3 $T/gpu_moe_ops_test --gtest_filter='Sm90_MoeAlign*' > $R/san_memcheck_align.log 2>&1; echo "memcheck align rc $?"
B=$PB/bench/bench_moe_layer; B0=$PB/bench/bench_moe_layer_base
common="--preset qwen3.5-35b-a3b,kimi-k2.5-ep8 --routed-only --decode 1,2,4,8,16,32 --prefill none --no-baseline"
echo "== $(st) A/B fp8 round 1"
$B0 $common --lora none,1x_r16,8x_r16 --out $R/fp8_base_r1 > $R/fp8_base_r1.log 2>&1
$B $common --lora none,1x_r16,8x_r16 --out $R/fp8_new128_r1 > $R/fp8_new128_r1.log 2>&1
echo "== $(st) ncu align source counters"
for v in new base; do
  bin=$B; [[ $v == base ]] && bin=$B0
  timeout 45 ncu --graph-profiling node -k regex:moe_align -c 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    $bin --preset qwen3.5-35b-a3b --routed-only --decode 16 --prefill none --no-baseline --lora 1x_r16 --reps 2 --warmup-ms 0 --out /tmp/ncu_$v > $R/ncu_src_${v}.txt 2>&1
done
timeout 45 ncu --graph-profiling node -k regex:moe_align -c 1 --section SourceCounters --page source --print-source sass --csv \
    $B --preset qwen3.5-35b-a3b --routed-only --decode 16 --prefill none --no-baseline --lora 1x_r16 --reps 2 --warmup-ms 0 --out /tmp/ncu_s > $R/ncu_sass_new.csv 2>&1
racecheck=1 compute-sanitizer --tool racecheck --error-exitcode 3 $T/gpu_moe_ops_test --gtest_filter='Sm90_MoeAlign*' > $R/san_racecheck_align.log 2>&1; echo "racecheck align rc $?"
echo "== $(st) A/B fp8 round 2"
$B0 $common --lora none,1x_r16,8x_r16 --out $R/fp8_base_r2 > $R/fp8_base_r2.log 2>&1
$B $common --lora none,1x_r16,8x_r16 --out $R/fp8_new128_r2 > $R/fp8_new128_r2.log 2>&1
$B --preset qwen3.5-35b-a3b,kimi-k2.5-ep8 --routed-only --decode 1,16 --prefill none --no-baseline --experts nvfp4 --lora none,1x_r16 --out $R/nvfp4_new128 > $R/nvfp4_new128.log 2>&1
echo "== $(st) all GPU tests"
OUT=$R/gpurun timeout 150 scripts/gpu-run --prebuilt $PB --skip-sanitize --skip-bench > $R/gpurun.log 2>&1
echo "gpu-run rc $?"; tail -30 $R/gpurun.log
echo "== $(st) done"
