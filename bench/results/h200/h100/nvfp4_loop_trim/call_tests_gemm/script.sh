# The NVFP4 decode loop trimmed (bench "new") against the head's build ("old"): tests,
# GEMMs alone and the routed layer; then the defaults build's tests, decode steps, sanitizer and
# the engine headline as time allows.
left() { echo $(( DEADLINE - $(date +%s) )); }
T=$PB/tests; B=$PB/bench
runt() {  # runt NAME TIMEOUT [gtest args]
  local t=$1 to=$2; shift 2
  [[ -x $T/$t ]] || { echo "missing $t"; return; }
  local s=$(date +%s); timeout $to $T/$t "$@" > $R/test_$t.log 2>&1; local rc=$?
  echo "$t rc=$rc $(( $(date +%s) - s ))s $(grep -E '^\[  (PASSED|FAILED) ' $R/test_$t.log | tr '\n' ' ')"
  grep -E "^\[  FAILED  \]" $R/test_$t.log | head -8
}
echo "== $(date +%T) nvfp4 tests"
runt gpu_moe_gemm_nvfp4_test 120
runt gpu_moe_layer_nvfp4_test 120
mkdir -p $R/gemm_old $R/gemm_new $R/gemm_old2 $R/gemm_new2 $R/layer_old $R/layer_new
echo "== $(date +%T) bench_moe_gemm old / new (left $(left))"
$B/bench_moe_gemm.old --preset qwen3.5-35b-a3b,kimi-k2.5-ep8 --reps 30 --out $R/gemm_old > $R/gemm_old.log 2>&1; echo "old rc $?"
$B/bench_moe_gemm --preset qwen3.5-35b-a3b,kimi-k2.5-ep8 --reps 30 --out $R/gemm_new > $R/gemm_new.log 2>&1; echo "new rc $?"
$B/bench_moe_gemm --preset kimi-k2.5-ep8,qwen3.5-35b-a3b --decode 1,16,64 --reps 30 --out $R/gemm_new2 > $R/gemm_new2.log 2>&1; echo "new2 rc $?"
$B/bench_moe_gemm.old --preset kimi-k2.5-ep8,qwen3.5-35b-a3b --decode 1,16,64 --reps 30 --out $R/gemm_old2 > $R/gemm_old2.log 2>&1; echo "old2 rc $?"
echo "== $(date +%T) ncu nvfp4 GEMMs old / new (left $(left))"
for v in old new; do
  bin=$B/bench_moe_gemm; [[ $v == old ]] && bin=$B/bench_moe_gemm.old
  timeout 100 ncu --clock-control none -k 'regex:moe_gemm_nvfp4' -c 4 \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active \
    $bin --preset kimi-k2.5-ep8 --decode 16 --reps 1 --out $R/ncu_$v > $R/ncu_nvfp4_$v.txt 2>&1; echo "$v rc $?"
  grep -E "moe_gemm_nvfp4|gpu__time|dram__|inst_executed|issue_active|warps_active" $R/ncu_nvfp4_$v.txt | head -30
done
echo "== $(date +%T) bench_moe_layer nvfp4 old / new (left $(left))"
for v in old new; do
  bin=$B/bench_moe_layer; [[ $v == old ]] && bin=$B/bench_moe_layer.old
  timeout $(( $(left) - 10 )) $bin --preset qwen3.5-35b-a3b,kimi-k2.5-ep8 --routed-only --decode 1,4,16,32,64,128 \
    --prefill none --lora none,1x_r16 --no-baseline --reps 20 --experts nvfp4 --out $R/layer_$v > $R/layer_$v.log 2>&1; echo "$v rc $?"
done
echo "== $(date +%T) memcheck nvfp4 gemm (left $(left))"
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 $T/gpu_moe_gemm_nvfp4_test > $R/san_memcheck_nvfp4_gemm.log 2>&1
echo "rc $? $(grep -E 'ERROR SUMMARY' $R/san_memcheck_nvfp4_gemm.log | tail -1)"
echo "== $(date +%T) tests (left $(left))"
runt gpu_attention_test 90
runt gpu_model_shapes_gpu_test 150
runt gpu_model_gpu_test 150
runt gpu_moe_layer_test 90
runt gpu_engine_gpu_test 150
for tool in memcheck racecheck; do
  (( $(left) < 90 )) && break
  echo "== $(date +%T) $tool attention (left $(left))"
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 3 $T/gpu_attention_test --gtest_filter='GpuFlashInfer*' > $R/san_$tool.log 2>&1
  echo "rc $? $(grep -E 'ERROR SUMMARY' $R/san_$tool.log | tail -1)"
done
for v in "qwen3-30b-a3b" "qwen3.5-35b-a3b"; do
  (( $(left) < 60 )) && break
  echo "== $(date +%T) decode step $v (left $(left))"
  $B/bench_decode_step --preset $v --batch-sizes 16,64 --adapters 0,1,8 --context 2048 --steps 4 \
    --out $R/ds > $R/ds_$v.log 2>&1; echo "rc $?"
  grep -E "^## B|^step span" $R/ds_$v.log | paste - - | sed 's/, [0-9]* kernels.*//'
done
echo "== $(date +%T) done (left $(left))"
