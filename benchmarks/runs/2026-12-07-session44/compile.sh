# Session 44, first call: compile the presets' default runs into the benchmark
# cache (JAX executables, PTX, XLA's per-fusion autotune results), then copy the
# autotune results out. 1b takes one 32k microbatch on an H200, two of 16k on an H100.
source benchmarks/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
M1B=$(( ${MIB:-0} >= 100000 ? 32768 : 16384 ))
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
(timeout 520 python3 benchmarks/throughput.py --runs "1b/prenorm,1b/mhar,1b/mhar_b8" \
  --micro_tokens $M1B --compile_only --compile_jobs 3 --compile_timeout 400 \
  > $OUT/compile-1b.txt 2>&1) &
timeout 520 python3 benchmarks/throughput.py \
  --runs "350m/prenorm,350m/mhar,350m/mhar_b8,100m/prenorm,100m/mhar,100m/mhar_b8" \
  --micro_tokens 32768 --compile_only --compile_jobs 3 --compile_timeout 400 \
  > $OUT/compile-presets.txt 2>&1
wait
C=/tmp/mhar_jax_bench_cache
echo "ptx entries: $(ls $C/mhar_jax_ptx | wc -l)"
ls $C
[ -d $C/xla_gpu_per_fusion_autotune_cache_dir ] && cp -r $C/xla_gpu_per_fusion_autotune_cache_dir $OUT/at
du -sh $OUT/at 2>/dev/null
grep -h -E "compiled|error|Error|timed out" $OUT/compile-*.txt | grep -v Warning | tail -20
