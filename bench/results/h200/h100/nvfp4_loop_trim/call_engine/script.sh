# The engine. Kimi-K2.5 shapes with NVFP4 experts (as many decoder layers as fit, in = 2048, out = 256),
# the trimmed decode GEMM (moelora) against the head's build (moelora.old), then the one-adapter
# headlines of Qwen3-30B-A3B and Qwen3.5-35B-A3B at in = out = 2048 with the current defaults.
left() { echo $(( DEADLINE - $(date +%s) )); }
export LD_LIBRARY_PATH=$PB/lib:$LD_LIBRARY_PATH
mkdir -p $R/bench
for v in new old new2; do
  bin=$PB/moelora; [[ $v == old ]] && bin=$PB/moelora.old
  (( $(left) < 120 )) && break
  echo "== $(date +%T) kimi nvfp4 $v (left $(left))"
  timeout 200 $bin bench --device cuda --random-weights --preset kimi-k2.5 --quant nvfp4 --adapter-slots 2 \
    --max-lora-rank 16 --random-adapters 1 --synth-rank 16 --batch-sizes 16,32,64 --input-len 2048 \
    --output-len 256 --max-layers fit --json $R/bench/engine_kimi-k2.5_nvfp4_fit_1adapter_out256_$v.json \
    > $R/engine_kimi_$v.log 2>&1; echo "rc $?"
  grep -E 'decode step|tok/s|E[123]' $R/engine_kimi_$v.log | head -12
done
for preset in qwen3-30b-a3b qwen3.5-35b-a3b; do
  (( $(left) < 200 )) && break
  echo "== $(date +%T) engine $preset 1 adapter (left $(left))"
  timeout $(( $(left) - 15 )) $PB/moelora bench --device cuda --random-weights --preset $preset --random-adapters 1 \
    --synth-rank 16 --batch-sizes 16,32,64 --input-len 2048 --output-len 2048 \
    --json $R/bench/engine_${preset}_1adapter_2048.json > $R/engine_$preset.log 2>&1; echo "rc $?"
  tail -25 $R/engine_$preset.log
done
echo "== $(date +%T) done (left $(left))"
