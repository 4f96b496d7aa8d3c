#!/usr/bin/env bash
# GPU-machine sessions in stages, each of which fits a 10-minute call (results land in $OUT):
#   HS_STAGES=tests,kcuda,kcpu,small,split bash tests/gpu/device_session.sh
#   tests: build, GPU + kernel tests; htests: only the hybrid runtime's; kcuda / kcpu: kernel benchmarks (CPU: 16 threads; by software
#   prefetch mode too with HS_PREFETCH_MODES="0 1 2")
#   small: decode of a Gemma-3-270M-shaped and a Llama-7B-shaped model all on the GPU
#   split: the 13B layer split (-ngl 11) and CPU-only
#   synth13: a 13B-shaped F16 model in PowerInfer layout with a power-law profile in /dev/shm
#   hybrid: hs-bench hybrid on it: hybrid vs layer split at 4/8/11/24 GiB vs CPU only, peak memory
#   hprof: a hybrid step at HS_PROFILE_BUDGET GiB as graphs / host nodes / events, host time per part
#   (runs before hybrid)
#   hvar: the graphed step at HS_PROFILE_BUDGET under each of HS_VARIANTS (env settings, ';'-separated)
#   One 10-minute call fits HS_STAGES=synth13,hybrid,hprof after a build (~5 min with -n 16).
#   scenario: `hs-bench scenario` for each of HS_SCENARIOS (default "S4 S5"; S1 alone fills a call)
#   serve: the server's GPU tests, then a 32-client load test of hs-serve on a 7B-shaped model in /dev/shm
#   chain: S1's Falcon-40B at 24 GiB, a decode step's host time per part (graphs vs the event path)
#   s1ab: S1's step with host nodes / the polled hand-over / the FFN joined first, alternating, one process
#   s2ab: S2's step with two- / one-plane activations and the polled hand-over, alternating
#   pdltests: the layer / sparse-op / model GPU tests with programmatic dependent launch on (HS_CUDA_PDL=1)
#   pdl: a 7B-shaped F16 model all on the GPU and the CUDA kernels, with it off and on alternately
#   att: a 7B-shaped F16 model all on the GPU with the attention kernel's old and new unrolling, alternately,
#   then where its decode step's time goes (tests/gpu/profile_decode.py)
#   fuse: GPU tests of the fused decode kernels, then a 7B-shaped F16 model all on the GPU with the norms and gated
#   activation folded into the GEMVs and not (HS_CUDA_FUSE), the k/v store and attention combine folded into the
#   attention kernel and not (HS_CUDA_ATT_FUSE), alternating (HS_FUSE_RUNS), then where its decode step's time goes
#   kq4: the Q4_0 row-dot against x in two 8-bit planes and in one (HS_ACT_PLANES=2/1), alternating, after its tests
#   kq8: the Q8_0 row-dot as it is and staged against x in two planes (HS_CUDA_STAGED_Q8=1), side by side
#   q4wide: one token's Q4_0 dots on the Xeon four blocks at a time vs the 256-bit form (HS_Q4_WIDE), 1 and 16 threads,
#   then their dense GEMV from memory prefetching ahead or not (HS_Q4_PREFETCH)
#   s5ab: S5's model CPU-only sparse (hs-run --vram-budget 0) with HS_Q4_WIDE=1/0 and HS_ACT_PLANES=2/1, alternating,
#   at 16 threads and HS_S5_T2=1 also at 2
#   nextrows: listed Q4_0 rows asking for the next group's rows or not (HS_NEXT_ROWS=1/0), the row-dot at 1 and 16
#   threads, then S2's step with and without, alternating
#   pages: listed rows from 4 KiB pages vs 2 MiB pages (anonymous, tmpfs, a file on disk; 1 and 16 threads), then S2's
#   step with its model in /dev/shm (tmpfs: 4 KiB pages) and on disk (page-cache large folios: 2 MiB pages), alternating
#   ceiling: listed rows only read (csrc/cpu_probe.cpp) against the row-dot, Q4_0 13B / 70B and F16 13B rows, 1 and 16
#   threads, asking 1 or 2 groups ahead (tests/gpu/read_ceiling_bench.py), then S2's step so (HS_NEXT_ROWS=1/2, and 2
#   with 128-neuron chunks) and with the old 16-neuron chunks (HS_FFN_CHUNK=16), alternating
#   s5chunk: S5's CPU-only sparse decode through hs-run with HS_FFN_CHUNK=16 and 64, alternating (HS_S5_VARIANTS:
#   ';'-separated env settings, e.g. "HS_FFN_CHUNK=16;HS_FFN_CHUNK=64;HS_NEXT_ROWS=0")
#   s5run: S5's model through hs-run, CPU-only sparse (--vram-budget 0) vs dense (-ngl 0), 16 threads, alternating
#   pollab: S5's CPU-only sparse decode (16 threads, HS_POLL_T) through hs-run and through hs-bench's child process
#   alone and beside another process reading NVML every HS_POLL_PERIODS seconds (the parent's peak-memory poll),
#   HS_POLL_ROUNDS times
#   bundle: the fused sparse FFN over a neuron's rows bundled side by side (views of one gate | up | down_t tensor) against
#   the three tensors of today's files, alternating: 70B Q4_0 and 13B F16 rows, 1 and 16 threads (tests/gpu/bundle_rows_bench.py)
#   streams: a dense GEMV's rows as 1 / 4 / 8 interleaved streams a thread (HS_GEMV_STREAMS; 16 and 1 threads), then S5's model
#   with 4 and 8 through hs-run, sparse and dense, alternating
#   compute: the listed-rows row-dot, axpy and fused FFN with the rows in cache against from memory, Q4_0 / Q8_0 / F16 70B
#   rows, 1 and 16 threads (tests/gpu/compute_ceiling_bench.py: whether the cores' arithmetic or the memory bounds them)
# The GPU machine cannot download: the wheels it lacks (gguf, pulp) travel in .whl/ (git-ignored), which the
# device tool's call must carry (carry: [".whl"]); without them nothing below imports.
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ ! -d .whl ] && ! python3 -c "import gguf, pulp" 2>/dev/null; then
  echo "device_session.sh: .whl/ (the gguf and pulp wheels) did not come along: carry it" >&2
  exit 2
fi
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
lscpu | grep -i "model name\|^L[23]\|^core" | tr -s " "  # the host CPU and its caches (a bench's 'from memory' must exceed L3)
( time python3 -m hybridsparse.runtime.kernels ) 2>&1 | tail -4

STAGES=",${HS_STAGES:-tests,small},"
# a Gemma-3-270M-shaped model (random weights, F16: the real file cannot travel here) in /dev/shm
GEMMA_SHAPE=/dev/shm/gemma3-270m-shape-f16.gguf
write_gemma_shape() {
[ -f $GEMMA_SHAPE ] || python3 - "$GEMMA_SHAPE" <<'PY'
import sys, torch, transformers as tf
from hybridsparse.runtime.convert import write_gguf, byte_level_vocab
torch.manual_seed(0)
cfg = tf.Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                          max_position_embeddings=32768, query_pre_attn_scalar=256)
write_gguf(sys.argv[1], cfg, tf.Gemma3ForCausalLM(cfg).state_dict().items(), dtype="f16",
           extra_metadata=byte_level_vocab(262144))
PY
}

# S5's model (7B Q4_0, PowerInfer layout, Q8_0 predictors) for the s5ab and pollab stages
M5=${HS_M5:-/dev/shm/relu-llama-2-7b-q4_0-powerinfer-pred-q8_0.gguf}
write_s5_model() {
[ -f $M5 ] || hs-bench synth --shape relu-llama-2-7b --dtype q4_0 --layout powerinfer --predictor-type q8_0 -o /dev/shm 2>&1 | tail -1
}

M13=/dev/shm/relu-llama-2-13b-f16-powerinfer.gguf  # synth13's model (planted statistics, exact predictors)
if [[ $STAGES == *,htests,* ]]; then  # the hybrid runtime's GPU tests and the CPU ops they stand on
  timeout ${HS_TEST_TIMEOUT:-300} python3 -m pytest -q --tb=short -rf ${HS_TEST_ARGS:-tests/gpu/test_hybrid_cuda.py tests/gpu/test_pipeline_cuda.py tests/test_sparse_ops.py} ${HS_TEST_K:+-k "$HS_TEST_K"} 2>&1 \
    | tee "$OUT/pytest-hybrid.txt" | tail -25
fi
if [[ $STAGES == *,tests,* ]]; then
  python3 -m pytest -q tests/gpu tests/test_sparse_ops.py tests/test_quants.py tests/test_architectures.py tests/test_hybrid.py 2>&1 \
    | tee "$OUT/pytest.txt" | tail -15
fi
if [[ $STAGES == *,kcuda,* ]]; then
  hs-bench kernels --device cuda --reps 5 --json "$OUT/kernels-h200-cuda.json" 2>&1 | tail -60
fi
if [[ $STAGES == *,kcpu,* ]]; then
  for pf in ${HS_PREFETCH_MODES:-}; do  # software prefetch modes side by side (csrc/cpu_matmul.cpp)
    echo "HS_PREFETCH=$pf"
    HS_PREFETCH=$pf MB_THREADS=1,16 MB_CPU_ONLY=1 PYTHONPATH="${PYTHONPATH:-}:$PWD/tests" python3 tests/gpu/microbench.py 2>&1
  done
  hs-bench kernels --device cpu -t 16 --shapes llama-2-13b,llama-2-70b --reps 5 \
    --json "$OUT/kernels-h200-cpu-t16.json" 2>&1 | tail -30
fi

if [[ $STAGES == *,small,* ]]; then
# the Gemma-3-270M-shaped model all on the GPU
write_gemma_shape
hs-bench run -m $GEMMA_SHAPE --compare-graphs --reps 3 --json "$OUT/bench_gemma_shape_gpu.json" 2>&1 | tail -4
hs-bench synth --shape llama-7b --dtype f16 -o /dev/shm 2>&1 | tail -1
hs-bench run -m /dev/shm/relu-llama-2-7b-f16.gguf --reps 3 --json "$OUT/bench_llama7b_f16_gpu.json" 2>&1 | tail -4
python3 tests/gpu/profile_decode.py /dev/shm/relu-llama-2-7b-f16.gguf 2>&1 | tee "$OUT/profile_llama7b.txt" | tail -30
HS_CUDA_GEMV=cublas hs-bench run -m /dev/shm/relu-llama-2-7b-f16.gguf --reps 3 --json "$OUT/bench_llama7b_f16_gpu_cublas.json" 2>&1 | tail -4
rm -f /dev/shm/relu-llama-2-7b-f16.gguf
fi
if [[ $STAGES == *,split,* ]]; then
# the dense layer split at ~8 GiB of VRAM (HARDWARE.md's llama.cpp setting for this shape: -ngl 11)
hs-bench synth --shape llama-13b --dtype f16 -o /dev/shm 2>&1 | tail -1
hs-bench run -m /dev/shm/relu-llama-2-13b-f16.gguf -ngl 11 -t 16 --reps 1 -n 32 --json "$OUT/bench_llama13b_f16_ngl11.json" 2>&1 | tail -4
hs-bench run -m /dev/shm/relu-llama-2-13b-f16.gguf -ngl 0 -t 16 --reps 1 -n 32 --json "$OUT/bench_llama13b_f16_cpu.json" 2>&1 | tail -4
rm -f /dev/shm/relu-llama-2-13b-f16.gguf
fi
if [[ $STAGES == *,synth13,* ]]; then
[ -f $M13 ] || ( time hs-bench synth --shape llama-13b --dtype f16 --layout powerinfer -o /dev/shm ) 2>&1 | tail -4
ls -la /dev/shm
fi
if [[ $STAGES == *,hprof,* ]]; then
HS_HYBRID_TIMING=1 timeout 150 python3 tests/gpu/profile_hybrid.py $M13 ${HS_PROFILE_BUDGET:-11} 2>&1 \
  | grep -v "^hybrid:\|placing layers" | head -60 | tee "$OUT/profile_hybrid.txt"
fi
if [[ $STAGES == *,hvar,* ]]; then  # the graphed step under OpenMP/thread variants, side by side
IFS=';' read -ra variants <<< "${HS_VARIANTS:-HS_THREADS=16;OMP_WAIT_POLICY=active;OMP_PROC_BIND=close OMP_PLACES=cores;HS_THREADS=15 OMP_WAIT_POLICY=active}"
for v in "${variants[@]}"; do
  echo "== $v" | tee -a "$OUT/profile_variants.txt"
  env $v HS_PROFILE_MODES=${HS_PROFILE_MODES:-graphs} timeout 90 python3 tests/gpu/profile_hybrid.py $M13 \
    ${HS_PROFILE_BUDGET:-11} 2>&1 | grep "per token" | tee -a "$OUT/profile_variants.txt"
done
fi
if [[ $STAGES == *,hybrid,* ]]; then
hs-bench hybrid -m $M13 --mode ${HS_MODE:-predictor} -t 16 -n ${HS_N:-24} --budgets ${HS_BUDGETS:-4,8,11,24} \
  --timeout 200 ${HS_HYBRID_ARGS:-} --json "$OUT/hybrid_llama13b_f16${HS_TAG:-}.json" 2>&1 | tail -30
fi
if [[ $STAGES == *,scenario,* ]]; then
if [ "${HS_HANDOVER:-}" = auto ]; then  # the faster hand-over of the s1ab/s2ab stage's alternating runs (mean ms)
  HS_HANDOVER=$(cat "$OUT"/profile_s*_ab.txt 2>/dev/null | awk '/^graphs \+ host nodes/ {n+=$5; nc++}
    /^the same, polled hand-over/ {p+=$5; pc++} END {print (nc && pc && p/pc < 0.97*n/nc) ? "poll" : "node"}')
  echo "HS_HANDOVER=$HS_HANDOVER (from the alternating runs)"
fi
[ -n "${HS_HANDOVER:-}" ] && export HS_HANDOVER  # recorded in the JSON only when set
for s in ${HS_SCENARIOS:-S4 S5}; do
  echo "== scenario $s"
  hs-bench scenario $s -o /dev/shm --json "$OUT/scenario-$s.json" ${HS_SCENARIO_ARGS:-} 2>&1 | tr '\r' '\n' \
    | grep -v "^hybrid:\|^writing\|^placing\|^ *$" | tail -25
done
fi
if [[ $STAGES == *,serve,* ]]; then
timeout ${HS_TEST_TIMEOUT:-200} python3 -m pytest -q --tb=short -rf tests/gpu/test_server_cuda.py tests/test_server.py 2>&1 \
  | tee "$OUT/pytest-serve.txt" | tail -15
[ -f /dev/shm/relu-llama-2-7b-f16-powerinfer.gguf ] || hs-bench synth --shape relu-llama-2-7b --layout powerinfer -o /dev/shm 2>&1 | tail -1
timeout 300 hs-bench serve -m /dev/shm/relu-llama-2-7b-f16-powerinfer.gguf -t 16 --clients 32 --duration ${HS_SERVE_S:-60} \
  --single-duration 15 -c 256 --server-args "${HS_SERVE_ARGS:---vram-budget 16}" --json "$OUT/serve-h200-7b.json" 2>&1 | tail -15
fi
if [[ $STAGES == *,chain,* ]]; then  # where S1's per-layer time goes: the Falcon-40B step by part
MF=/dev/shm/relu-falcon-40b-f16-powerinfer.gguf
[ -f $MF ] || hs-bench synth --shape relu-falcon-40b --layout powerinfer -o /dev/shm 2>&1 | tail -1
HS_HYBRID_TIMING=1 HS_PROFILE_MODES=${HS_PROFILE_MODES:-graphs,events} timeout 300 python3 tests/gpu/profile_hybrid.py \
  $MF 24 predictor 2>&1 | grep -v "^hybrid:\|placing layers\|^ *[0-9]\+ \+[0-9]\+/" | tail -40 | tee "$OUT/profile_hybrid_s1.txt"
fi
if [[ $STAGES == *,s1ab,* ]]; then  # S1's step side by side in alternating order: host nodes, the polled
# hand-over, Falcon's FFN joined before its attention (HS_AB_MODES; then e.g. HS_HANDOVER=poll with the scenario stage)
PRED=${HS_PRED:-f16}  # the predictors' type (the scenario stage then reuses the model: HS_SCENARIO_ARGS="--predictor-type $PRED")
MF=/dev/shm/relu-falcon-40b-f16-powerinfer$([ $PRED = f16 ] || echo -pred-$PRED).gguf
[ -f $MF ] || hs-bench synth --shape relu-falcon-40b --layout powerinfer --predictor-type $PRED -o /dev/shm 2>&1 | tail -1
HS_PROFILE_MODES=${HS_AB_MODES:-graphs,poll,serial,graphs,poll,serial,skip,poll-skip} timeout 300 \
  python3 tests/gpu/profile_hybrid.py $MF 24 predictor 16 2>&1 | grep --line-buffered "per token" | tee "$OUT/profile_s1_ab.txt"
fi
if [[ $STAGES == *,s2ab,* ]]; then  # S2's step with two- and one-plane activations (HS_ACT_PLANES), alternating
M70=/dev/shm/relu-llama-2-70b-q4_0-powerinfer.gguf
[ -f $M70 ] || hs-bench synth --shape relu-llama-2-70b --dtype q4_0 --layout powerinfer -o /dev/shm 2>&1 | tail -1
HS_PROFILE_MODES=${HS_AB_MODES:-graphs,one-plane,graphs,one-plane,poll,graphs} timeout 300 \
  python3 tests/gpu/profile_hybrid.py $M70 11 predictor 12 2>&1 | grep --line-buffered "per token" | tee "$OUT/profile_s2_ab.txt"
fi
if [[ $STAGES == *,nextrows,* ]]; then  # listed Q4_0 rows asking for the next group's rows or not (HS_NEXT_ROWS)
RF_VAR=HS_NEXT_ROWS RF_VALUES=1,0 RF_TYPES=Q4_0 RF_DENSITIES=0.03,0.1,0.33 RF_THREADS=1,16 timeout 200 \
  python3 tests/gpu/rows_in_flight_bench.py 2>&1 | tee "$OUT/next-rows.txt"
M70=/dev/shm/relu-llama-2-70b-q4_0-powerinfer.gguf
[ -f $M70 ] || hs-bench synth --shape relu-llama-2-70b --dtype q4_0 --layout powerinfer -o /dev/shm 2>&1 | tail -1
HS_PROFILE_MODES=poll,poll-nonext,poll,poll-nonext,poll,poll-nonext timeout 300 \
  python3 tests/gpu/profile_hybrid.py $M70 11 predictor 12 2>&1 | grep --line-buffered "per token" | tee "$OUT/profile_s2_next.txt"
fi
if [[ $STAGES == *,pdltests,* ]]; then
HS_CUDA_PDL=1 timeout ${HS_TEST_TIMEOUT:-300} python3 -m pytest -q --tb=short -rf tests/gpu/test_cuda.py \
  tests/gpu/test_cuda_sparse.py tests/gpu/test_cuda_layers.py ${HS_TEST_K:+-k "$HS_TEST_K"} 2>&1 | tee "$OUT/pytest-pdl.txt" | tail -15
fi
if [[ $STAGES == *,pdl,* ]]; then
M7=/dev/shm/relu-llama-2-7b-f16.gguf
[ -f $M7 ] || hs-bench synth --shape llama-7b --dtype f16 -o /dev/shm 2>&1 | tail -1
for pdl in 0 1 0 1; do
  echo "HS_CUDA_PDL=$pdl"
  HS_CUDA_PDL=$pdl hs-bench run -m $M7 --reps 3 --json "$OUT/bench_7b_pdl$pdl.json" 2>&1 | tail -2
done
for pdl in 0 1; do
  HS_CUDA_PDL=$pdl hs-bench kernels --device cuda --types F16,Q4_0 --shapes llama-2-7b,llama-2-70b --densities 1.0,0.1 \
    --reps 3 --json "$OUT/kernels-cuda-pdl$pdl.json" 2>&1 | tail -9
done
fi
if [[ $STAGES == *,att,* ]]; then  # the attention kernel's loads in flight: 4/4 rows (HS_CUDA_ATT_UNROLL=0) vs 8/16, alternating
M7=/dev/shm/relu-llama-2-7b-f16.gguf
[ -f $M7 ] || hs-bench synth --shape llama-7b --dtype f16 -o /dev/shm 2>&1 | tail -1
for v in ${HS_ATT_RUNS:-0 1 0 1}; do
  echo "HS_CUDA_ATT_UNROLL=$v"
  HS_CUDA_ATT_UNROLL=$v hs-bench run -m $M7 --reps 3 --json "$OUT/bench_7b_att$v.json" 2>&1 | tail -2
done
python3 tests/gpu/profile_decode.py $M7 2>&1 | tee "$OUT/profile_llama7b.txt" | tail -30
fi
if [[ $STAGES == *,fuse,* ]]; then
timeout ${HS_TEST_TIMEOUT:-300} python3 -m pytest -q --tb=short -rf tests/gpu/test_cuda.py tests/gpu/test_cuda_layers.py \
  tests/gpu/test_cuda_sparse.py ${HS_TEST_K:+-k "$HS_TEST_K"} 2>&1 | tee "$OUT/pytest-fuse.txt" | tail -15
M7=/dev/shm/relu-llama-2-7b-f16.gguf
[ -f $M7 ] || hs-bench synth --shape llama-7b --dtype f16 -o /dev/shm 2>&1 | tail -1
# runs named GEMV fusion + attention fusion (HS_CUDA_FUSE, HS_CUDA_ATT_FUSE), "w": two warps a row for 4096-row
# GEMVs (HS_CUDA_WANT_WARPS=8448)
for v in ${HS_FUSE_RUNS:-00 11 00 11}; do
  echo "HS_CUDA_FUSE=${v:0:1} HS_CUDA_ATT_FUSE=${v:1:1} ${v:2}"
  HS_CUDA_FUSE=${v:0:1} HS_CUDA_ATT_FUSE=${v:1:1} HS_CUDA_WANT_WARPS=$([ "${v:2}" = w ] && echo 8448) \
    hs-bench run -m $M7 --reps 3 --json "$OUT/bench_7b_fuse$v.json" 2>&1 | tail -2
done
python3 tests/gpu/profile_decode.py $M7 2>&1 | tee "$OUT/profile_llama7b_fused.txt" | tail -24
if [ -n "${HS_FUSE_GEMMA:-}" ]; then  # the same alternation on a Gemma-3-270M-shaped model (launch- and latency-bound)
write_gemma_shape
for v in $HS_FUSE_GEMMA; do
  echo "gemma HS_CUDA_FUSE=${v:0:1} HS_CUDA_ATT_FUSE=${v:1:1}"
  HS_CUDA_FUSE=${v:0:1} HS_CUDA_ATT_FUSE=${v:1:1} hs-bench run -m $GEMMA_SHAPE --reps 3 \
    --json "$OUT/bench_gemma_fuse$v.json" 2>&1 | tail -2
done
fi
fi
if [[ $STAGES == *,kq4,* ]]; then
timeout 240 python3 -m pytest -q --tb=short -rf tests/gpu/test_cuda_sparse.py -k staged 2>&1 | tee "$OUT/pytest-kq4.txt" | tail -5
for v in 2 1 2 1; do
  HS_ACT_PLANES=$v hs-bench kernels --device cuda --types Q4_0 --shapes llama-2-70b,falcon-40b --densities 1.0,0.1 \
    --reps 3 --json "$OUT/kernels-cuda-q4-planes$v.json" 2>&1 | tail -5
done
fi
if [[ $STAGES == *,kq8,* ]]; then  # Q8_0 rows: half-blocks against float x, then staged against x in two planes
for v in 0 1; do
  HS_CUDA_STAGED_Q8=$v hs-bench kernels --device cuda --types Q8_0 --shapes llama-2-70b,falcon-40b --densities 1.0,0.1 \
    --reps 3 --json "$OUT/kernels-cuda-q8-staged$v.json" 2>&1 | tail -5
done
fi
if [[ $STAGES == *,q4wide,* ]]; then
python3 tests/gpu/q4_wide_bench.py 1 16 2>&1 | tee "$OUT/q4-wide.txt"
fi
if [[ $STAGES == *,s5ab,* ]]; then
write_s5_model
for t in 16 ${HS_S5_T2:+2}; do
  for v in ${HS_S5_RUNS:-12 02 11 01 12 02 11 01}; do  # HS_Q4_WIDE, HS_ACT_PLANES
    printf "t=%s HS_Q4_WIDE=%s HS_ACT_PLANES=%s: " $t ${v:0:1} ${v:1:1} | tee -a "$OUT/s5-ab.txt"
    HS_Q4_WIDE=${v:0:1} HS_ACT_PLANES=${v:1:1} hs-run -m $M5 --vram-budget 0 -t $t -p "Once upon a time" -n ${HS_S5_N:-48} \
      2>&1 >/dev/null | grep -i "eval" | tr '\n' ' ' | tee -a "$OUT/s5-ab.txt"; echo | tee -a "$OUT/s5-ab.txt"
  done
done
fi
if [[ $STAGES == *,pollab,* ]]; then  # S5's sparse decode at 16 threads: hs-run, and hs-bench's child alone / beside an NVML poll
write_s5_model
CFG='{"engine": "hybrid", "vram_budget": 0.0, "model": "'$M5'", "threads": '${HS_POLL_T:-16}', "n_predict": 64, "mode": "predictor",
  "cache_type": "float16", "ctx_size": 512, "prompt_tokens": 64, "reps": 3, "cpu_bw": 80.0, "gpu_bw": 0.0}'
for r in $(seq ${HS_POLL_ROUNDS:-2}); do
  printf "hs-run: " | tee -a "$OUT/poll-ab.txt"
  hs-run -m $M5 --vram-budget 0 -t ${HS_POLL_T:-16} -p "Once upon a time" -n 64 2>&1 >/dev/null | grep "  eval time" | tee -a "$OUT/poll-ab.txt"
  for per in ${HS_POLL_PERIODS:-0 0.005 0.05}; do  # seconds between NVML reads in another process (0: none)
    if [ $per != 0 ]; then python3 -c "import sys, time
from hybridsparse.runtime.nvml import device_used_bytes as used
while True: used(0); time.sleep($per)" & PP=$!; fi
    printf "hybrid-one, NVML poll every %s s: " $per | tee -a "$OUT/poll-ab.txt"
    python3 -m hybridsparse.runtime.bench hybrid-one "$CFG" 2>/dev/null | tail -1 | python3 -c "import json, sys
d = json.loads(sys.stdin.read()); print(round(d['decode_tok_s'], 2), [round(x['decode_tok_s'], 2) for x in d['reps']])" \
      | tee -a "$OUT/poll-ab.txt"
    [ $per != 0 ] && kill $PP
  done
done
fi
if [[ $STAGES == *,s3prof,* ]]; then  # S3's step (13B F16 at 8 GiB, 15 attentions on the CPU): time per layer kind and part
M3=/dev/shm/relu-llama-2-13b-f16-powerinfer-pred-q8_0.gguf  # the scenario's model (hs-bench scenario S3 --predictor-type q8_0)
[ -f $M3 ] || hs-bench synth --shape relu-llama-2-13b --dtype f16 --layout powerinfer --predictor-type q8_0 -o /dev/shm 2>&1 | tail -1
HS_HYBRID_TIMING=1 HS_PROFILE_MODES=${HS_S3_MODES:-events,layers} \
  timeout ${HS_PROF_TIMEOUT:-300} python3 tests/gpu/profile_hybrid.py $M3 8 predictor 16 2>&1 \
  | grep -v "^hybrid:\|placing layers" | tee "$OUT/profile_s3.txt" | tail -75
fi
if [[ $STAGES == *,s5prof,* ]]; then  # S5's CPU-only sparse step at 16 threads: time per layer and part, then per call of the block (cpu_step_parts.py; HS_S5_PROFILE=0: that alone)
write_s5_model
[ "${HS_S5_PROFILE:-1}" = 0 ] || HS_HYBRID_TIMING=1 HS_PROFILE_MODES=events,layers \
  HS_THREADS=${HS_POLL_T:-16} timeout 200 python3 tests/gpu/profile_hybrid.py $M5 0 predictor 32 2>&1 \
  | grep -v "^hybrid:\|placing layers" | tee "$OUT/profile_s5.txt" | tail -50
HS_THREADS=${HS_POLL_T:-16} timeout 200 python3 tests/gpu/cpu_step_parts.py $M5 32 2>&1 \
  | tr '\r' '\n' | grep -v "placing layers\|^ *$" | tee "$OUT/s5-parts.txt" | tail -14
fi
if [[ $STAGES == *,pages,* ]]; then  # 4 KiB vs 2 MiB pages under listed rows, then S2's model in /dev/shm vs on disk
mkdir -p hs-disk
for t in ${HS_PAGE_TYPES:-Q4_0}; do
  T=$t TH=1,16 HP_DIR=hs-disk timeout 200 python3 tests/gpu/hugepage_rows_bench.py 2>&1 | grep -v Warn | tee -a "$OUT/pages-rows.txt"
done
M70=/dev/shm/relu-llama-2-70b-q4_0-powerinfer.gguf
[ -f $M70 ] || hs-bench synth --shape relu-llama-2-70b --dtype q4_0 --layout powerinfer -o /dev/shm 2>&1 | tail -1
[ -f hs-disk/$(basename $M70) ] || ( time cp $M70 hs-disk/ ) 2>&1 | grep real
for r in ${HS_PAGE_ROUNDS:-1 2}; do
  for m in $M70 hs-disk/$(basename $M70); do
    echo "$m" | tee -a "$OUT/pages-s2.txt"
    HS_PROFILE_MODES=poll,poll timeout 150 python3 tests/gpu/profile_hybrid.py $m 11 predictor 12 2>&1 \
      | grep --line-buffered -E "per token|model mapping" | tee -a "$OUT/pages-s2.txt"
  done
done
fi
if [[ $STAGES == *,ceiling,* ]]; then  # the memory's ceiling for scattered rows against the row-dot
( T=Q4_0 TH=1,16 timeout 120 python3 tests/gpu/read_ceiling_bench.py
  K=8192 T=Q4_0 TH=16 D=0.1,0.27,1.0 timeout 90 python3 tests/gpu/read_ceiling_bench.py
  T=F16 TH=16 D=0.1,0.33,1.0 timeout 90 python3 tests/gpu/read_ceiling_bench.py ) 2>&1 | tee "$OUT/read-ceiling.txt"
M70=/dev/shm/relu-llama-2-70b-q4_0-powerinfer.gguf
[ -f $M70 ] || hs-bench synth --shape relu-llama-2-70b --dtype q4_0 --layout powerinfer -o /dev/shm 2>&1 | tail -1
HS_PROFILE_MODES=poll,poll-c16,poll-ahead2,poll-ahead2-c128,poll,poll-c16,poll-ahead2,poll-ahead2-c128 timeout 400 \
  python3 tests/gpu/profile_hybrid.py $M70 11 predictor 12 2>&1 | grep --line-buffered "per token" | tee "$OUT/profile_s2_ahead.txt"
fi
if [[ $STAGES == *,s5chunk,* ]]; then  # S5's CPU-only sparse decode by HS_FFN_CHUNK (16 until session 29, 64 since), alternating
write_s5_model
IFS=';' read -ra S5_VARIANTS <<< "${HS_S5_VARIANTS:-HS_FFN_CHUNK=16;HS_FFN_CHUNK=64}"
for r in ${HS_S5_ROUNDS:-1 2}; do
  for v in "${S5_VARIANTS[@]}"; do
    printf "%s: " "$v" | tee -a "$OUT/s5-chunk.txt"
    env $v hs-run -m $M5 --vram-budget 0 -t ${HS_POLL_T:-16} -n 64 -p "$(printf 'hello world %.0s' $(seq 32))" --temp 0 \
      2>&1 >/dev/null | grep " eval time" | tee -a "$OUT/s5-chunk.txt"
  done
done
fi
if [[ $STAGES == *,bundle,* ]]; then  # whether a bundled FFN layout would pay on this CPU
( BR_TYPE=Q4_0 BR_SHAPE=70b BR_THREADS=1,16 BR_DENSITIES=0.03,0.1 timeout 150 python3 tests/gpu/bundle_rows_bench.py
  BR_TYPE=F16 BR_SHAPE=13b BR_THREADS=16 BR_DENSITIES=0.03,0.1 timeout 120 python3 tests/gpu/bundle_rows_bench.py ) 2>&1 \
  | tee "$OUT/bundle-rows.txt"
fi
if [[ $STAGES == *,compute,* ]]; then  # the cores' arithmetic on listed rows in cache against from memory
timeout 240 python3 tests/gpu/compute_ceiling_bench.py 2>&1 | grep -v Warn | tee "$OUT/compute-ceiling.txt"
fi
if [[ $STAGES == *,s5run,* ]]; then  # S5's model through hs-run, CPU-only sparse vs dense (-ngl 0), alternating
write_s5_model
for r in ${HS_S5_ROUNDS:-1 2}; do
  for eng in "--vram-budget 0" "-ngl 0"; do
    printf "%s: " "$eng" | tee -a "$OUT/s5-hsrun.txt"
    hs-run -m $M5 $eng -t ${HS_POLL_T:-16} -n 128 -p "$(printf 'hello world %.0s' $(seq 32))" --temp 0 2>&1 >/dev/null \
      | grep "eval time" | tee -a "$OUT/s5-hsrun.txt"
  done
done
fi
if [[ $STAGES == *,streams,* ]]; then  # a dense GEMV's rows as 1/2/4/8 interleaved streams a thread (HS_GEMV_STREAMS)
GS_MODES=${GS_MODES:-1,4,8} python3 tests/gpu/gemv_streams_bench.py 16 1 2>&1 | tee "$OUT/gemv-streams.txt"
write_s5_model
for v in ${HS_STREAM_RUNS:-4 8 4 8 4 8}; do  # S5's model on 16 threads, sparse and dense, alternating
  for eng in "--vram-budget 0" "-ngl 0"; do
    printf "HS_GEMV_STREAMS=%s %s: " $v "$eng" | tee -a "$OUT/gemv-streams.txt"
    HS_GEMV_STREAMS=$v hs-run -m $M5 $eng -t 16 -p "Once upon a time" -n 48 2>&1 >/dev/null | grep "  eval time" \
      | tee -a "$OUT/gemv-streams.txt"
  done
done
fi
if [[ $STAGES == *,sprobe,* ]]; then  # batched hybrid decode step by step (what hs-serve runs with many clients)
[ -f /dev/shm/relu-llama-2-7b-f16-powerinfer.gguf ] || hs-bench synth --shape relu-llama-2-7b --layout powerinfer -o /dev/shm 2>&1 | tail -1
timeout 240 python3 tests/gpu/serve_probe.py /dev/shm/relu-llama-2-7b-f16-powerinfer.gguf ${HS_PROBE_BUDGET:-16} ${HS_PROBE_N:-1 4 32} 2>&1 \
  | tr '\r' '\n' | grep -v "^placing\|^writing\|^ *$" | tee "$OUT/serve_probe.txt" | tail -30
fi
