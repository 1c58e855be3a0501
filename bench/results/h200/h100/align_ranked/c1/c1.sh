# c1: the ranked align, NVFP4 align PDL, NVFP4 rows read once: tests, A/B against cfbdc16's bench,
# timelines, ncu of the align, then every GPU test.
set -x
export MOELORA_TEST_DATA_DIR=$PWD/tests/data MOELORA_BINARY_DIR=$PB
T=$PB/tests
st() { date +%H:%M:%S; }
echo "== $(st) focused tests"
$T/gpu_moe_ops_test > $R/gpu_moe_ops_test.log 2>&1; echo "ops rc $?"
$T/gpu_moe_gemm_nvfp4_test --gtest_filter='*Rows*' > $R/gpu_nvfp4_rows.log 2>&1; echo "rows rc $?"
$T/gpu_moe_layer_test > $R/gpu_moe_layer_test.log 2>&1; echo "layer rc $?"
$T/gpu_moe_layer_nvfp4_test > $R/gpu_moe_layer_nvfp4_test.log 2>&1; echo "layer nvfp4 rc $?"
grep -h -E "^\[  (PASSED|FAILED) " $R/gpu_*.log
B=$PB/bench/bench_moe_layer; B0=$PB/bench/bench_moe_layer_base
common="--preset qwen3.5-35b-a3b,kimi-k2.5-ep8 --routed-only --decode 1,2,4,8,16,32,64,128 --prefill none --no-baseline"
echo "== $(st) A/B fp8"
for r in 1 2; do
  $B0 $common --lora none,1x_r16,8x_r16 --out $R/fp8_base_r$r > $R/fp8_base_r$r.log 2>&1
  $B $common --lora none,1x_r16,8x_r16 --out $R/fp8_new_r$r > $R/fp8_new_r$r.log 2>&1
done
echo "== $(st) A/B nvfp4"
for r in 1 2; do
  $B0 $common --experts nvfp4 --lora none,1x_r16 --out $R/nvfp4_base_r$r > $R/nvfp4_base_r$r.log 2>&1
  $B $common --experts nvfp4 --lora none,1x_r16 --out $R/nvfp4_new_r$r > $R/nvfp4_new_r$r.log 2>&1
done
echo "== $(st) LoRA side grid cap (new build)"
$B --preset qwen3.5-35b-a3b --routed-only --decode 1,4,16,32,64,128 --prefill none --no-baseline --lora 1x_r16,8x_r16 --lora-side-ctas sms --out $R/fp8_new_cap_sms > $R/fp8_new_cap_sms.log 2>&1
echo "== $(st) sanitizer on the changed kernels"
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 3 $T/gpu_moe_ops_test --gtest_filter='Sm90_MoeAlign*' > $R/san_${tool}_align.log 2>&1; echo "$tool align rc $?"
  compute-sanitizer --tool $tool --error-exitcode 3 $T/gpu_moe_gemm_nvfp4_test --gtest_filter='*Rows*' > $R/san_${tool}_rows.log 2>&1; echo "$tool rows rc $?"
done
echo "== $(st) timelines"
$B --preset qwen3.5-35b-a3b --routed-only --decode 1,4,16,64 --prefill none --no-baseline --lora none,1x_r16 --timeline 1,4,16,64 --out $R/tl_new > $R/tl_new.log 2>&1
$B0 --preset qwen3.5-35b-a3b --routed-only --decode 1,4,16,64 --prefill none --no-baseline --lora none,1x_r16 --timeline 1,4,16,64 --out $R/tl_base > $R/tl_base.log 2>&1
$B --preset kimi-k2.5-ep8 --experts nvfp4 --routed-only --decode 1,16,128 --prefill none --no-baseline --lora none --timeline 1,16,128 --out $R/tl_nvfp4_new > $R/tl_nvfp4_new.log 2>&1
$B0 --preset kimi-k2.5-ep8 --experts nvfp4 --routed-only --decode 1,16,128 --prefill none --no-baseline --lora none --timeline 1,16,128 --out $R/tl_nvfp4_base > $R/tl_nvfp4_base.log 2>&1
echo "== $(st) ncu align"
for v in new base; do
  bin=$B; [[ $v == base ]] && bin=$B0
  for lo in none 1x_r16; do
    timeout 40 ncu --graph-profiling node -k regex:moe_align -c 3 --section SpeedOfLight --section WarpStateStats --section LaunchStats \
      $bin --preset qwen3.5-35b-a3b --routed-only --decode 16 --prefill none --no-baseline --lora $lo --reps 2 --warmup-ms 0 --out /tmp/ncu_$v > $R/ncu_align_${v}_${lo}.txt 2>&1
  done
done
echo "== $(st) all GPU tests"
OUT=$R/gpurun timeout 220 scripts/gpu-run --prebuilt $PB --skip-sanitize --skip-bench > $R/gpurun.log 2>&1
echo "gpu-run rc $?"; tail -30 $R/gpurun.log
echo "== $(st) done"
