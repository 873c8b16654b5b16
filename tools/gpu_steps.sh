#!/usr/bin/env bash
# Named measurement steps for one held GPU machine (../shared/gpu/README.md installs MLX there first).
# Each step has its own time limit and writes its results under $OUT, its output into one log
# ($OUT/steps.log: a device call brings back at most 8 files), so one device call runs several of them and
# a step that fails or overruns still leaves the others' results.
#   usage (on the GPU machine): PYTHONPATH=/root/site:$PWD bash tools/gpu_steps.sh STEP [STEP...]
#   steps: mask-tests attn-mask attn-lq gen-lq attn-recheck stages-tests attn-stages gen-stages l2pf-tests attn-l2pf fold-tests gen-fold gen-fold-ab gen-128k-fold trace-fold lds3-tests attn-lds3 gen-128k-lds3 append-bits append-tests probe-resident gen-resident-fix trace-resident append-resident lds-tests attn-lds gen-lds gen-128k-lds resume-final resume-group gen-pinned-32k upload-host upload-tests resume-pinned gen-pinned idx42-tests attn-idx42 gen-idx42 gen-128k-idx42 args-tests attn-args gen-args gen-128k-args pcsample-args attn-late pcsample prefill crossover trace-crossover gen-now gen-128k-now attn-pair gen-fuse trace-fuse quick-mma quick-tests attn-quick trace-quick gen-quick trace trace-128k resident-tests gen-resident gen-resident-2 append attn-occ4 bound-tests gen-bound gen-confirm gen-128k-bound gen-final-ref gen-128k-ref ref-tests ref-broken gen-ref gen-ref-long attn-layers malloc overhead diag attn-fused gen-fused gen-final gen-128k-fused inplace gen-noinplace parity-mma parity-simt attn gen-mma gen-simt gen-128k load model-check profile-resume profile-step host suite
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder whose files come back}"
py=${PYTHON:-python3}
tmp=${GPU_TMP:-/root/rvqtmp}; mkdir -p "$tmp"
log=$OUT/steps.log
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader; } \
  >> "$log" 2>&1 || true
gen=(tools/bench_generation.py --model random --arms kv,packed-2+2,packed-4+2,resident-2+2 --steps 4 --rounds 3)

step() {  # step NAME LIMIT_S CMD...: the command's output, status and seconds appended to steps.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "==== $name: $*" >> "$log"
  timeout -k 5 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "==== $name rc=$rc $((SECONDS - t0))s" | tee -a "$log"
}

for s in "$@"; do
  case $s in
    attn-recheck) step attn-recheck-22 120 $py tools/bench_attention.py --contexts 8192,32768,131072 --bits 2+2 \
        --rounds 8 --k 10 --variants lds3,occ4,quickmax --json "$OUT/attention-recheck-22.json"
      step attn-recheck-42 100 $py tools/bench_attention.py --contexts 8192,32768,131072 --bits 4+2 \
        --rounds 8 --k 10 --variants occ4,quickmax --json "$OUT/attention-recheck-42.json" ;;
    mask-tests) RVQ_ATTN_PARITY_REPORT=$OUT/parity-mask.txt step mask-tests 330 \
        $py -m pytest -q -rfE -p no:cacheprovider -n 8 tests/test_attention_mma_gpu.py tests/test_attention_gpu.py \
        tests/test_decode_step_gpu.py tests/test_cache_inplace_gpu.py tests/test_kernel_cache_gpu.py tests/test_attention.py ;;
    attn-mask) step attn-mask 100 $py tools/bench_attention.py --contexts 8192,32768,131072 --bits 2+2,4+2 \
        --rounds 8 --k 10 --json "$OUT/attention-mask.json" ;;
    attn-lq) step attn-lq-22 200 $py tools/bench_attention.py --contexts 1024,8192,32768,131072 --bits 2+2 \
        --rounds 15 --k 10 --variants lds3,quickmax,lds3+quickmax --json "$OUT/attention-lq-22.json"
      step attn-lq-42 120 $py tools/bench_attention.py --contexts 1024,8192,32768,131072 --bits 4+2 \
        --rounds 15 --k 10 --variants quickmax --json "$OUT/attention-lq-42.json" ;;
    gen-lq) step gen-lq 240 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@lds3+quickmax,packed-4+2,packed-4+2@quickmax --steps 6 --rounds 5 \
        --contexts 1024,8192,32768,131072 --json "$OUT/gen-lq.json" --md "$OUT/gen-lq.md" ;;
    stages-tests) RVQ_ATTN_PARITY_REPORT=$OUT/parity-stages.txt step stages-tests 170 \
        $py -m pytest -q -rfE -p no:cacheprovider -n 8 tests/test_attention_mma_gpu.py -k "keep_every_bit or chosen_by_setting or ring" ;;
    attn-stages) step attn-stages-22 100 $py tools/bench_attention.py --contexts 8192,32768,131072 --bits 2+2 \
        --rounds 8 --k 10 --variants stages2,stages3,stages4 --json "$OUT/attention-stages-22.json"
      step attn-stages-42 90 $py tools/bench_attention.py --contexts 8192,32768,131072 --bits 4+2 \
        --rounds 8 --k 10 --variants stages2,stages3 --json "$OUT/attention-stages-42.json" ;;
    gen-stages) step gen-stages 180 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@stages3,packed-4+2,packed-4+2@stages3 --steps 6 --rounds 3 \
        --contexts 8192,32768,131072 --json "$OUT/gen-stages.json" --md "$OUT/gen-stages.md" ;;
    l2pf-tests) RVQ_ATTN_PARITY_REPORT=$OUT/parity-l2pf.txt step l2pf-tests 240 \
        $py -m pytest -q -rfE -p no:cacheprovider -n 8 tests/test_attention_mma_gpu.py -k "keep_every_bit or chosen_by_setting" ;;
    attn-l2pf) step attn-l2pf-22 200 $py tools/bench_attention.py --contexts 8192,32768,131072 --bits 2+2 \
        --rounds 10 --k 10 --variants l2pf2,l2pf4,l2pf8 --json "$OUT/attention-l2pf-22.json"
      step attn-l2pf-42 200 $py tools/bench_attention.py --contexts 8192,32768,131072 --bits 4+2 \
        --rounds 10 --k 10 --variants l2pf2,l2pf4,l2pf8 --json "$OUT/attention-l2pf-42.json" ;;
    crossover) step crossover 300 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@sdpa,packed-4+2,packed-4+2@sdpa --steps 8 --rounds 5 \
        --contexts 1024,2048,4096,8192,16384,32768 --json "$OUT/gen-crossover.json" --md "$OUT/gen-crossover.md" ;;
    trace-crossover) RVQSTORE_CUPTI=$PWD/.gpu/e/libcupti.so.13 step trace-crossover 200 $py tools/trace_step.py \
        --arms kv,packed-2+2,packed-2+2@sdpa --contexts 1024,8192,32768 --steps 6 --rounds 3 \
        --json "$OUT/trace-step-crossover.json" --md "$OUT/trace-step-crossover.md" ;;
    gen-now) step gen-now 300 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-4+2,resident-2+2 --steps 8 --rounds 5 --contexts 1024,8192,32768 \
        --resume --resume-rounds 2 --tmp "$tmp" --json "$OUT/gen-now.json" --md "$OUT/gen-now.md" ;;
    gen-128k-now) step gen-128k-now 240 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-4+2 --steps 6 --rounds 3 --contexts 131072 \
        --json "$OUT/gen-128k-now.json" --md "$OUT/gen-128k-now.md" ;;
    upload-tests) step upload-tests 300 $py -m pytest -q -rfE -p no:cacheprovider tests/test_device_upload.py ;;
    upload-tests-more) step upload-tests-more 300 $py -m pytest -q -rfE -p no:cacheprovider \
        tests/test_format_read_sections.py tests/test_device_memory.py tests/test_snapshot_fuzz.py tests/test_cache.py \
        tests/test_codec_state_format.py tests/test_format_rans.py ;;
    resume-pinned) step resume-pinned 300 $py tools/profile_resume.py --context 32768 --rounds 3 --tmp "$tmp" \
        --upload pinned,managed --json "$OUT/profile-resume-pinned.json" ;;
    gen-pinned-32k) step gen-pinned-32k 300 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-4+2 --steps 4 --rounds 3 --contexts 32768 \
        --resume --resume-rounds 3 --tmp "$tmp" --json "$OUT/gen-pinned-32k.json" --md "$OUT/gen-pinned-32k.md" ;;
    resume-final) step resume-final-32k 200 $py tools/profile_resume.py --context 32768 --rounds 3 --tmp "$tmp" \
        --json "$OUT/profile-resume-32k.json"
      step resume-final-1k 200 $py tools/profile_resume.py --context 1024 --rounds 5 --tmp "$tmp" \
        --json "$OUT/profile-resume-1k.json" ;;
    resume-group) step resume-group-1k 200 $py tools/profile_resume.py --context 1024 --rounds 5 --tmp "$tmp" \
        --upload pinned,each,managed --cprofile "$OUT/cprofile-resume-1k.txt" --json "$OUT/profile-resume-1k.json"
      step resume-group-32k 300 $py tools/profile_resume.py --context 32768 --rounds 3 --tmp "$tmp" \
        --upload pinned,pinned@16,each --json "$OUT/profile-resume-32k.json" ;;
    upload-host) step upload-host 200 $py tools/bench_upload.py --json "$OUT/upload-host.json" ;;
    gen-pinned) step gen-pinned 300 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-4+2 --steps 4 --rounds 3 --contexts 1024,8192,32768 \
        --resume --resume-rounds 3 --tmp "$tmp" --json "$OUT/gen-pinned.json" --md "$OUT/gen-pinned.md" ;;
    fold-tests) RVQ_ATTN_PARITY_REPORT=$OUT/parity-fold.txt step fold-tests 300 \
        $py -m pytest -q -rfE -p no:cacheprovider -n 8 tests/test_decode_step_gpu.py tests/test_cache_append_gpu.py \
        tests/test_cache_inplace_gpu.py tests/test_decode_step.py ;;
    gen-fold) step gen-fold 360 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@nofold,packed-4+2,packed-4+2@nofold --steps 8 --rounds 5 \
        --contexts 1024,8192,32768 --stream-tokens 16 --json "$OUT/gen-fold.json" --md "$OUT/gen-fold.md" ;;
    gen-fold-ab) step gen-fold-ab 400 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@nofold --steps 8 --rounds 15 --contexts 1024,8192,32768 --stream-tokens 32 \
        --json "$OUT/gen-fold-ab.json" --md "$OUT/gen-fold-ab.md" ;;
    gen-128k-fold) step gen-128k-fold 240 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@nofold,packed-4+2,packed-4+2@nofold --steps 6 --rounds 3 --contexts 131072 \
        --json "$OUT/gen-128k-fold.json" --md "$OUT/gen-128k-fold.md" ;;
    trace-fold) RVQSTORE_CUPTI=$PWD/.gpu/e/libcupti.so.13 step trace-fold 300 $py tools/trace_step.py \
        --arms kv,packed-2+2,packed-2+2@nofold --contexts 1024,32768 --steps 6 --rounds 3 \
        --json "$OUT/trace-fold.json" --md "$OUT/trace-fold.md" ;;
    lds3-tests) RVQ_ATTN_PARITY_REPORT=$OUT/parity-lds3.txt step lds3-tests 200 \
        $py -m pytest -q -rfE -p no:cacheprovider -n 8 tests/test_attention_mma_gpu.py tests/test_kernel_cache.py \
        -k "keep_every_bit or chosen_by_setting or shared_memory or kernel_cache" ;;
    attn-lds3) step attn-lds3 150 $py tools/bench_attention.py --contexts 8192,32768,131072 --bits 2+2 \
        --rounds 15 --k 10 --variants lds3 --json "$OUT/attention-lds3.json" ;;
    gen-128k-lds3) step gen-128k-lds3 150 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@lds3 --steps 6 --rounds 3 --contexts 131072 \
        --json "$OUT/gen-128k-lds3.json" --md "$OUT/gen-128k-lds3.md" ;;
    lds-tests) RVQ_ATTN_PARITY_REPORT=$OUT/parity-lds.txt step lds-tests 300 \
        $py -m pytest -q -rfE -p no:cacheprovider -n 8 tests/test_attention_mma_gpu.py tests/test_attention_gpu.py \
        tests/test_decode_step_gpu.py ;;
    attn-lds) step attn-lds-22 200 $py tools/bench_attention.py --contexts 1024,8192,32768,131072 --bits 2+2,4+2 \
        --rounds 15 --k 10 --variants lds1,nolds,pairs --json "$OUT/attention-lds-22.json"
      step attn-lds-42 200 $py tools/bench_attention.py --contexts 1024,8192,32768,131072 --bits 4+2,2+2 \
        --rounds 15 --k 10 --variants lds1,nolds,pairs --json "$OUT/attention-lds-42.json" ;;
    gen-lds) step gen-lds 300 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@nolds,packed-4+2,packed-4+2@nolds --steps 8 --rounds 5 \
        --contexts 1024,8192,32768 --json "$OUT/gen-lds.json" --md "$OUT/gen-lds.md" ;;
    gen-128k-lds) step gen-128k-lds 240 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@nolds,packed-4+2,packed-4+2@nolds --steps 6 --rounds 3 --contexts 131072 \
        --json "$OUT/gen-128k-lds.json" --md "$OUT/gen-128k-lds.md" ;;
    idx42-tests) RVQ_ATTN_PARITY_REPORT=$OUT/parity-idx42.txt step idx42-tests 300 \
        $py -m pytest -q -rfE -p no:cacheprovider -n 8 tests/test_attention_mma_gpu.py tests/test_attention_gpu.py \
        tests/test_decode_step_gpu.py ;;
    attn-idx42) step attn-idx42 200 $py tools/bench_attention.py --contexts 1024,8192,32768,131072 --bits 4+2,2+2 \
        --rounds 7 --k 10 --variants idx42 --json "$OUT/attention-idx42.json" ;;
    gen-idx42) step gen-idx42 300 $py tools/bench_generation.py --model random \
        --arms kv,packed-4+2,packed-4+2@noidx42 --steps 8 --rounds 5 --contexts 1024,8192,32768 \
        --json "$OUT/gen-idx42.json" --md "$OUT/gen-idx42.md" ;;
    gen-128k-idx42) step gen-128k-idx42 240 $py tools/bench_generation.py --model random \
        --arms kv,packed-4+2,packed-4+2@noidx42 --steps 6 --rounds 3 --contexts 131072 \
        --json "$OUT/gen-128k-idx42.json" --md "$OUT/gen-128k-idx42.md" ;;
    args-tests) RVQ_ATTN_PARITY_REPORT=$OUT/parity-device-args.txt step args-tests 300 \
        $py -m pytest -q -rfE -p no:cacheprovider -n 8 tests/test_attention_mma_gpu.py tests/test_attention_gpu.py \
        tests/test_cache_append_gpu.py tests/test_cache_inplace_gpu.py tests/test_decode_step_gpu.py \
        tests/test_kernel_cache_gpu.py tests/test_decode_step.py tests/test_device_args.py ;;
    attn-args) step attn-args 200 $py tools/bench_attention.py --contexts 1024,8192,32768,131072 --bits 2+2,4+2 \
        --rounds 7 --k 10 --variants hostargs,quickmax --json "$OUT/attention-args.json" ;;
    gen-args) step gen-args 300 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@hostargs,packed-4+2,packed-4+2@hostargs,resident-2+2,resident-2+2@hostargs \
        --steps 8 --rounds 5 --contexts 1024,8192,32768 --json "$OUT/gen-args.json" --md "$OUT/gen-args.md" ;;
    gen-128k-args) step gen-128k-args 240 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@hostargs,packed-2+2@quickmax,packed-4+2,packed-4+2@hostargs --steps 6 --rounds 3 \
        --contexts 131072 --json "$OUT/gen-128k-args.json" --md "$OUT/gen-128k-args.md" ;;
    pcsample-args) step pcsample-args 200 $py tools/pc_sample.py --lib $PWD/.gpu/e/libpcsampling.so \
        --cupti $PWD/.gpu/e/libcupti.so.13 --contexts 1024,32768 --bits 2+2,4+2 --calls 200 --period 8 \
        --json "$OUT/pcsample-args.json" --raw "$tmp/pcraw" ;;
    attn-late) step attn-late 240 $py tools/bench_attention.py --contexts 1024,8192,32768,131072 --bits 2+2,4+2 \
        --rounds 7 --k 10 --variants earlynorms --json "$OUT/attention-late.json" ;;
    pcsample) step pcsample 240 $py tools/pc_sample.py --lib $PWD/.gpu/e/libpcsampling.so \
        --cupti $PWD/.gpu/e/libcupti.so.13 --contexts 1024,32768,131072 --bits 2+2,4+2 --calls 200 --period 8 \
        --json "$OUT/pcsample.json" --raw "$tmp/pcraw" --cubins "$OUT/cubins.tar.gz" ;;
    prefill) step prefill 300 $py tools/bench_prefill.py --contexts 1024,8192,32768 --bits 2+2,4+2 \
        --queries 1,2,4,8,16,32,64,256 --rounds 5 --k 8 --layers 4 --json "$OUT/prefill.json" ;;
    attn-pair) step attn-pair 200 $py tools/bench_attention.py --contexts 1024,8192,32768 --bits 2+2 --rounds 3 \
        --k 10 --timeline --timeline-pair 2048 --json "$OUT/attention-pair.json" ;;
    gen-fuse) step gen-fuse 200 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@fuse,packed-4+2,packed-4+2@fuse --steps 8 --rounds 5 \
        --contexts 1024,8192,32768 --json "$OUT/gen-fuse.json" --md "$OUT/gen-fuse.md" ;;
    trace-fuse) RVQSTORE_CUPTI=$PWD/.gpu/e/libcupti.so.13 step trace-fuse 200 $py tools/trace_step.py \
        --arms kv,packed-2+2,packed-2+2@fuse --contexts 1024,32768 --steps 6 --rounds 3 \
        --json "$OUT/trace-step-fuse.json" --md "$OUT/trace-step-fuse.md" ;;
    quick-tests) RVQ_ATTN_PARITY_REPORT=$OUT/parity-quick.txt step quick-tests 300 \
        $py -m pytest -q -rfE -p no:cacheprovider tests/test_attention_mma_gpu.py tests/test_attention_gpu.py \
        tests/test_decode_step_gpu.py ;;
    quick-mma) RVQ_ATTN_PARITY_REPORT=$OUT/parity-quick-mma.txt step quick-mma 200 \
        $py -m pytest -q -rfE -p no:cacheprovider tests/test_attention_mma_gpu.py ;;
    attn-quick) step attn-quick 300 $py tools/bench_attention.py --contexts 1024,8192,32768,131072 --bits 2+2,4+2 \
        --rounds 7 --k 10 --variants slowboth,slowsplit,slowmerge --timeline --json "$OUT/attention-quick.json" ;;
    trace-quick) RVQSTORE_CUPTI=$PWD/.gpu/e/libcupti.so.13 step trace-quick 300 $py tools/trace_step.py \
        --arms kv,packed-2+2,packed-2+2@slowboth,packed-4+2,packed-4+2@slowboth --contexts 1024,32768 --steps 6 \
        --rounds 3 --json "$OUT/trace-step-quick.json" --md "$OUT/trace-step-quick.md" ;;
    gen-quick) step gen-quick 300 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@slowboth,packed-4+2,packed-4+2@slowboth --steps 8 --rounds 7 \
        --contexts 1024,8192,32768 --json "$OUT/gen-quick.json" --md "$OUT/gen-quick.md" ;;
    # append-bits: .gpu/oldtree holds the reference checkout (git archive REV rvqstore kernels pyproject.toml | tar -x -C .gpu/oldtree)
    append-bits) step append-bits-old 200 env -C .gpu/oldtree PYTHONPATH=/root/site $py ../../tools/dump_append.py \
            "$OUT/append-old.npz"
        step append-bits-new 200 $py tools/dump_append.py "$OUT/append-new.npz"
        step append-bits 60 $py tools/dump_append.py --compare "$OUT/append-old.npz" "$OUT/append-new.npz"
        rm -f "$OUT/append-old.npz" "$OUT/append-new.npz" ;;
    append-tests) RVQ_ATTN_PARITY_REPORT=$OUT/parity-append.txt step append-tests 300 \
        $py -m pytest -q -rfE -p no:cacheprovider tests/test_cache_append_gpu.py tests/test_cache_inplace_gpu.py \
        tests/test_decode_step_gpu.py tests/test_decode_step.py ;;
    probe-resident) step probe-resident 200 $py tools/probe_resident_eval.py --contexts 1024,8192,32768 \
        --json "$OUT/probe-resident.json" ;;
    gen-resident-fix) step gen-resident-fix 420 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-4+2,resident-2+2,resident-4+2 --steps 8 --rounds 5 --contexts 1024,8192,32768 \
        --json "$OUT/gen-resident-fix.json" --md "$OUT/gen-resident-fix.md" ;;
    trace-resident) RVQSTORE_CUPTI=$PWD/.gpu/e/libcupti.so.13 step trace-resident 300 $py tools/trace_step.py \
        --arms kv,resident-2+2,packed-2+2 --contexts 1024,32768 --steps 6 --rounds 3 \
        --json "$OUT/trace-resident.json" --md "$OUT/trace-resident.md" ;;
    append-resident) step append-resident 200 $py tools/bench_append.py --contexts 1024,8192,32768 --rounds 21 \
        --arms kv,packed-2+2,resident-2+2,resident-4+2 --json "$OUT/append-resident.json" ;;
    trace) RVQSTORE_CUPTI=$PWD/.gpu/e/libcupti.so.13 step trace 300 $py tools/trace_step.py \
        --arms kv,packed-2+2,packed-4+2,resident-2+2 --contexts 1024,32768 --steps 6 --rounds 3 \
        --json "$OUT/trace-step.json" --md "$OUT/trace-step.md" ;;
    trace-128k) RVQSTORE_CUPTI=$PWD/.gpu/e/libcupti.so.13 step trace-128k 240 $py tools/trace_step.py \
        --arms kv,packed-2+2 --contexts 131072 --steps 6 --rounds 3 \
        --json "$OUT/trace-step-128k.json" --md "$OUT/trace-step-128k.md" ;;
    resident-tests) RVQ_ATTN_PARITY_REPORT=$OUT/parity-resident.txt step resident-tests 300 \
        $py -m pytest -q -rfE -p no:cacheprovider tests/test_decode_step_gpu.py tests/test_cache_append_gpu.py \
        tests/test_cache_inplace_gpu.py tests/test_decode_step.py ;;
    gen-resident) step gen-resident 420 $py tools/bench_generation.py --model random \
        --arms kv,resident-2+2,resident-2+2@noinplace,resident-2+2@unbound,resident-4+2,resident-4+2@noinplace,packed-2+2 \
        --steps 8 --rounds 5 --contexts 1024,8192,32768 --json "$OUT/gen-resident.json" --md "$OUT/gen-resident.md" ;;
    append) step append 200 $py tools/bench_append.py --contexts 1024,32768 --rounds 21 \
        --arms kv,packed-2+2,packed-2+2@noinplace,resident-2+2,resident-2+2@noinplace,resident-2+2@unbound,resident-4+2 \
        --json "$OUT/append.json" ;;
    gen-resident-2) step gen-resident-2 420 $py tools/bench_generation.py --model random \
        --arms kv,resident-2+2,resident-2+2@noinplace,resident-4+2,packed-2+2,packed-4+2 \
        --steps 8 --rounds 7 --contexts 1024,8192,32768 --json "$OUT/gen-resident-2.json" --md "$OUT/gen-resident-2.md" ;;
    attn-occ4) step attn-occ4 240 $py tools/bench_attention.py --contexts 1024,8192,32768,131072 --bits 2+2,4+2 \
        --rounds 7 --k 10 --variants occ4 --json "$OUT/attention-occ4.json" ;;
    bound-tests) RVQ_ATTN_PARITY_REPORT=$OUT/parity-decode-step.txt step bound-tests 300 \
        $py -m pytest -q -rfE -p no:cacheprovider tests/test_decode_step_gpu.py tests/test_cache_inplace_gpu.py \
        tests/test_decode_step.py ;;
    gen-bound) step gen-bound 420 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@unbound,packed-2+2@fuse,packed-4+2,packed-4+2@unbound,resident-2+2 \
        --steps 8 --rounds 5 --contexts 1024,8192,32768 --resume --resume-rounds 2 --tmp "$tmp" \
        --json "$OUT/gen-bound.json" --md "$OUT/gen-bound.md" ;;
    gen-confirm) step gen-confirm 300 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-4+2,packed-2+2@unbound,resident-2+2 --steps 8 --rounds 5 \
        --contexts 1024,8192,32768 --resume --resume-rounds 3 --tmp "$tmp" \
        --json "$OUT/gen-confirm.json" --md "$OUT/gen-confirm.md" ;;
    gen-128k-bound) step gen-128k-bound 240 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@unbound,packed-2+2@fuse,packed-4+2 --steps 6 --rounds 3 --contexts 131072 \
        --json "$OUT/gen-128k-bound.json" --md "$OUT/gen-128k-bound.md" ;;
    gen-final-ref) step gen-final-ref 300 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@fuse,packed-2+2@binary,packed-4+2,packed-4+2@fuse,resident-2+2 \
        --steps 8 --rounds 5 --contexts 1024,8192,32768 --resume --resume-rounds 2 --tmp "$tmp" \
        --json "$OUT/gen-final-ref.json" --md "$OUT/gen-final-ref.md" ;;
    gen-128k-ref) step gen-128k-ref 240 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@fuse,packed-4+2 --steps 6 --rounds 3 --contexts 131072 \
        --json "$OUT/gen-128k-ref.json" --md "$OUT/gen-128k-ref.md" ;;
    ref-tests) RVQ_KERNEL_CACHE_PARITY_REPORT=$OUT/parity-kernel-cache.txt step ref-tests 300 \
        $py -m pytest -q -rfE -p no:cacheprovider tests/test_kernel_cache_gpu.py tests/test_kernel_ref.py ;;
    ref-broken) step ref-broken 120 $py -m pytest -q -rfE -p no:cacheprovider tests/test_kernel_cache_gpu.py \
        -k "does_not_find or second_process" ;;
    gen-ref-long) step gen-ref-long 330 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@binary,packed-4+2,packed-4+2@binary --steps 8 --rounds 6 \
        --contexts 1024,8192,32768 --json "$OUT/gen-ref-long.json" --md "$OUT/gen-ref-long.md" ;;
    gen-ref) step gen-ref 330 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@binary,packed-4+2,packed-4+2@binary,resident-2+2,resident-2+2@binary \
        --steps 4 --rounds 3 --contexts 1024,8192,32768 --json "$OUT/gen-ref.json" --md "$OUT/gen-ref.md" ;;
    inplace) RVQ_ATTN_PARITY_REPORT=$OUT/parity-inplace.txt step inplace 300 \
        $py -m pytest -q -rfE -p no:cacheprovider tests/test_cache_inplace_gpu.py tests/test_cache_append_gpu.py ;;
    gen-noinplace) step gen-noinplace 240 env RVQSTORE_INPLACE=0 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-4+2 --steps 4 --rounds 3 --contexts 1024,8192,32768 --kernel mma \
        --json "$OUT/gen-noinplace.json" --md "$OUT/gen-noinplace.md" ;;
    parity-mma) RVQ_ATTN_PARITY_REPORT=$OUT/parity-mma.txt step parity-mma 240 \
        $py -m pytest -q -rfE -p no:cacheprovider tests/test_attention_mma_gpu.py ;;
    parity-simt) RVQ_ATTN_PARITY_REPORT=$OUT/parity-simt.txt step parity-simt 240 \
        $py -m pytest -q -rfE -p no:cacheprovider tests/test_attention_gpu.py ;;
    diag) step diag 200 $py tools/bench_attention.py --contexts 32768,131072 --bits 2+2,4+2 --rounds 5 --k 10 \
        --breakdown --probes 1,2,3 --timeline --json "$OUT/attn-diag.json" ;;
    malloc) for v in 0 1; do
        step "overhead-tune$v" 60 env RVQSTORE_MALLOC_TUNE=$v $py tools/bench_launch_overhead.py \
          --json "$OUT/launch-overhead-tune$v.json"; done
      for v in 0 1; do
        step "gen-tune$v" 120 env RVQSTORE_MALLOC_TUNE=$v $py tools/bench_generation.py --model random \
          --arms kv,packed-2+2,packed-4+2,resident-2+2 --steps 4 --rounds 3 --contexts 1024,8192,32768 \
          --json "$OUT/gen-tune$v.json" --md "$OUT/gen-tune$v.md"; done ;;
    overhead) step overhead 120 $py tools/bench_launch_overhead.py --json "$OUT/launch-overhead.json" ;;
    attn-fused) step attn-fused 200 $py tools/bench_attention.py --contexts 1024,8192,32768,131072 --bits 2+2,4+2 \
        --rounds 7 --k 10 --variants fuse --timeline --json "$OUT/attention-fused.json" ;;
    gen-fused) step gen-fused 300 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@fuse,packed-4+2,packed-4+2@fuse --steps 4 --rounds 3 \
        --contexts 1024,8192,32768 --json "$OUT/gen-fused.json" --md "$OUT/gen-fused.md" ;;
    gen-final) step gen-final 300 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@fuse,packed-4+2,resident-2+2 --steps 6 --rounds 4 \
        --contexts 1024,8192,32768 --resume --resume-rounds 2 --tmp "$tmp" \
        --json "$OUT/gen-final.json" --md "$OUT/gen-final.md" ;;
    gen-128k-fused) step gen-128k-fused 240 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@fuse,packed-4+2 --steps 4 --rounds 2 --contexts 131072 \
        --json "$OUT/gen-128k-fused.json" --md "$OUT/gen-128k-fused.md" ;;
    attn-layers) step attn-layers 240 $py tools/bench_attention.py --contexts 8192,32768,131072 --bits 2+2,4+2 \
        --rounds 5 --k 8 --layers 4 --json "$OUT/attention-layers.json" ;;
    attn-swap) step attn-swap 200 $py tools/bench_attention.py --contexts 1024,8192,32768,131072 --bits 2+2,4+2 \
        --rounds 7 --k 10 --variants swap,noswap,occ4 --json "$OUT/attention-swap.json" ;;
    gen-swap) step gen-swap 330 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@noswap,packed-2+2@occ4,packed-4+2,packed-4+2@noswap --steps 8 --rounds 5 \
        --contexts 1024,8192,32768 --json "$OUT/gen-swap.json" --md "$OUT/gen-swap.md" ;;
    gen-128k-swap) step gen-128k-swap 200 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-2+2@noswap,packed-2+2@occ4,packed-4+2 --steps 6 --rounds 3 --contexts 131072 \
        --json "$OUT/gen-128k-swap.json" --md "$OUT/gen-128k-swap.md" ;;
    attn) step attn 240 $py tools/bench_attention.py --contexts 1024,8192,32768,131072 --bits 2+2,4+2 \
        --rounds 7 --k 10 --variants simt,mma --json "$OUT/attention.json" ;;
    gen-mma) step gen-mma 300 env RVQSTORE_TENSOR_CORES=1 $py "${gen[@]}" --contexts 1024,8192,32768 --kernel mma \
        --resume --resume-rounds 2 --tmp "$tmp" --json "$OUT/gen-mma.json" --md "$OUT/gen-mma.md" ;;
    gen-simt) step gen-simt 240 $py "${gen[@]}" --contexts 1024,8192,32768 --kernel simt \
        --json "$OUT/gen-simt.json" --md "$OUT/gen-simt.md" ;;
    gen-128k) step gen-128k 200 env RVQSTORE_TENSOR_CORES=1 $py tools/bench_generation.py --model random \
        --arms kv,packed-2+2,packed-4+2 --steps 4 --rounds 2 --contexts 131072 --kernel mma \
        --json "$OUT/gen-128k.json" --md "$OUT/gen-128k.md" ;;
    load) step load 200 $py tools/bench_load.py --contexts 32768 --rounds 3 --tmp "$tmp" \
        --json "$OUT/load.json" --md "$OUT/load.md" ;;
    model-check) step model-check 200 $py tools/bench_model_check.py --model random --layers 8 --rounds 5 --fresh-rounds 2 \
        --out "$OUT/model-check.txt" ;;
    profile-resume) step profile-resume 240 $py tools/profile_resume.py --context 32768 --rounds 3 --tmp "$tmp" \
        --json "$OUT/profile-resume.json" ;;
    profile-step) step profile-step 150 $py tools/profile_step.py --context 32768 --arms kv,packed-2+2 --steps 6 \
        --rounds 2 --profile --json "$OUT/profile-step.json" ;;
    host) step host 150 $py tools/profile_host.py --rounds 12 --attention-launches --json "$OUT/host-build-h200.json" ;;
    suite) step suite 560 $py -m pytest -v --tb=short -p no:cacheprovider -n 15 --durations=20 ;;
    *) echo "unknown step $s" | tee -a "$log" ;;
  esac
done
rm -rf "$tmp"
