#!/usr/bin/env bash
# The GPU checks in one command, for a machine with an NVIDIA GPU (never CI):
#   1. builds with CUDA (make CUDA=1) unless BUILD_DONE=1;
#   2. pg.cuda.selftest(): every CUDA kernel against its CPU kernel;
#   3. scripts/gpt2_check.lua --device=cuda against the clipped PyTorch fixture
#      (10 steps: loss and gradient norm of every step to 1e-5 relative, plus
#      the script's own loss / logits / gradient checks): one rank, then two
#      ranks with --tensor=2 and with --data=2 --zero=1 (NCCL when the node has
#      two GPUs; staged through the host when the ranks share one), and with
#      two GPUs --data=2 --zero=2 and --zero=3;
#      Then scripts/model_check.lua --device=cuda on the LLaMA fixture (GQA,
#      RoPE, RMSNorm, SwiGLU), one rank and --tensor=2: 10 steps' losses to 1e-5;
#      Then precision = "bf16" (cublasGemmEx) against the float64 fixture and
#      the CPU's bf16 run: spec/unit/bf16_check_spec.lua's device part;
#   4. scripts/bench_gpu.lua: GPT-2 124M tokens/s and MFU against the cuBLAS
#      FP32 sgemm rate, and with precision = "bf16" against the cuBLAS bf16
#      GemmEx rate, both measured in the same run (BENCH_ARGS to change it), and
#      where python3 has torch, the same step in PyTorch on the same GPU
#      (scripts/bench_torch.py --device cuda, fp32, TF32 off) and the ratio;
#   4b. unless TABLE=0: the issue's bf16 table: GPT-2 124M and LLaMA ~1B (TinyLlama's shape) at T in TABLE_SEQS
#      (default 1024,2048,4096), TABLE_TOKENS tokens a step (default 16384; the batch is tokens / T), pipegoose
#      (bench_gpu.lua --precision=bf16) and PyTorch 2.x with its best settings (scripts/bench_torch_gpu.py: bf16
#      autocast, SDPA flash, torch.compile, fused AdamW) in the same run, each MFU against its own bf16 GEMM rate
#      measured in the run; printed as one table (tokens/s, MFU, MFU with attention, the ratio); then GPT-2 124M
#      again with PG_FLASH_BF16=0 (the float32 attention core instead of the tensor-core kernels). PyTorch is
#      python3's torch, else a venv made from the wheels in .gpu/wheels (the GPU machine has no network: fill it
#      here with `pip download torch --dest .gpu/wheels` for its Python and CUDA, and carry .gpu/);
#   5. unless SPECS=0: the dist specs marked '-- device worlds:' at those
#      sizes with PG_TEST_DEVICE=cuda (run_tests.sh), on this GPU: each layout
#      against the serial CPU run. (spec/unit/device_spec.lua is the emulator's:
#      it counts the emulated device's calls.)
# Everything it prints also goes to $OUT/gpu_check.log (OUT defaults to
# build/gpu-check). Exit status 0 when every check passed.
#
# DRY=1: only step 4b, on the emulated device (build-emu/pglua, make emu) with the tiny models at T = 8 and 16,
# and PyTorch's --dry (the CPU) where torch is installed: checks the scripts and the table, not the speed.
#
# The machine needs the build's Debian packages (scripts/install-deps.sh) and
# the CUDA toolkit with cuBLAS and NCCL (CUDA_HOME, default /usr/local/cuda).
# A machine without the Debian packages takes scripts/gpu_bundle.sh's
# .gpu/bundle.tar.xz: when it is there, it is unpacked and used (no build).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }
run() { "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }
failed=0

say "== gpu_check $(date -u +%FT%TZ) on $(hostname)"
LD_BEFORE=${LD_LIBRARY_PATH:-} # python3 and torch get the machine's own libraries

# python3 with torch: the machine's, else a venv from .gpu/wheels (no network); empty when neither
torch_python() {
  if LD_LIBRARY_PATH=$LD_BEFORE python3 -c 'import torch' 2> /dev/null; then echo python3; return; fi
  local venv=$OUT/torch-venv
  if [ -d .gpu/wheels ] && { [ -x "$venv/bin/python" ] || {
    LD_LIBRARY_PATH=$LD_BEFORE python3 -m venv "$venv" &&
      LD_LIBRARY_PATH=$LD_BEFORE "$venv/bin/pip" install -q --no-index --find-links .gpu/wheels torch >&2; }; } &&
    LD_LIBRARY_PATH=$LD_BEFORE "$venv/bin/python" -c 'import torch' 2> /dev/null; then
    echo "$venv/bin/python"
  fi
}

# bf16_table PGLUA SEQS TOKENS MODEL:TORCH_MODEL... (TORCH_ARGS: extra bench_torch_gpu.py arguments, e.g. --dry)
# One bench_gpu.lua and one bench_torch_gpu.py run per model, then the table of both joined on model and BxT.
bf16_table() {
  local pglua=$1 seqs=$2 tokens=$3 status=0 m ours theirs py
  shift 3
  : > "$OUT/table_ours.out"
  : > "$OUT/table_torch.out"
  py=$(torch_python)
  for m in "$@"; do
    ours=${m%%:*} theirs=${m#*:}
    say "== bf16: bench_gpu.lua --model=$ours --seqs=$seqs --tokens=$tokens"
    run timeout -k 5 "${BENCH_TIMEOUT:-900}" "$pglua" scripts/bench_gpu.lua --model="$ours" --precision=bf16 \
      --seqs="$seqs" --tokens="$tokens" ${BENCH_TABLE_ARGS:-} | tee -a "$OUT/table_ours.out" || status=1
    if [ -n "$py" ]; then
      say "== bf16: bench_torch_gpu.py --model $theirs --seqs $seqs --tokens $tokens ${TORCH_ARGS:-}"
      # shellcheck disable=SC2086
      LD_LIBRARY_PATH=$LD_BEFORE run timeout -k 5 "${BENCH_TIMEOUT:-900}" "$py" scripts/bench_torch_gpu.py \
        --model "$theirs" --seqs "$seqs" --tokens "$tokens" ${TORCH_ARGS:-} | tee -a "$OUT/table_torch.out" || status=1
    fi
  done
  [ -n "$py" ] || say "   (no PyTorch: python3 has no torch and .gpu/wheels has none)"
  say "== bf16 table (MFU against each framework's bf16 GEMM rate measured in this run)"
  awk '
    FNR == 1 { file++ }
    file == 1 && $3 == "tokens_per_s" { key = $1 " " $2; order[++n] = key; tps[key] = $4; mfu[key] = $8; mfua[key] = $10 }
    file == 2 && $1 == "torch" && $4 == "tokens_per_s" { key = $2 " " $3; ttps[key] = $5; tmfu[key] = $9; tmfua[key] = $11 }
    END {
      printf "| model | B x T | pipegoose tokens/s | MFU | MFU+attn | PyTorch tokens/s | MFU | MFU+attn | ratio |\n"
      printf "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
      for (i = 1; i <= n; i++) {
        k = order[i]; split(k, f, " ")
        t = (k in ttps) ? ttps[k] : "-"
        r = (k in ttps && ttps[k] > 0) ? sprintf("%.3f", tps[k] / ttps[k]) : "-"
        printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", f[1], f[2], tps[k], mfu[k], mfua[k], t,
          (k in tmfu) ? tmfu[k] : "-", (k in tmfua) ? tmfua[k] : "-", r
      }
    }' "$OUT/table_ours.out" "$OUT/table_torch.out" | tee -a "$LOG"
  return $status
}

if [ "${DRY:-0}" = 1 ]; then
  say "== DRY=1: the bf16 table on the emulated device, tiny models"
  TORCH_ARGS="--dry ${TORCH_ARGS:-}" BENCH_TABLE_ARGS="--steps=1 --warmup=0 --peak-n=16" \
    bf16_table "${PGLUA:-build-emu/pglua}" 8,16 32 tiny:gpt2-tiny llama-tiny:llama-tiny || failed=1
  say "== gpu_check (dry): $([ $failed = 0 ] && echo passed || echo FAILED)"
  exit $failed
fi
if [ -f .gpu/bundle.tar.xz ]; then
  [ -f .gpu/env.sh ] || tar -xJf .gpu/bundle.tar.xz -C .gpu || exit 1
  . .gpu/env.sh
  BUILD_DONE=1 PGLUA=.gpu/bin/pglua
  run ldd "$PGLUA" | grep -E 'not found|cudart|nccl|lua|mpi\.'
fi
command -v nvidia-smi > /dev/null && run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
if [ "${BUILD_DONE:-0}" != 1 ]; then
  say "== build"
  run make -j"$(nproc)" CUDA=1 all || { say "build failed"; exit 1; }
fi
PGLUA=${PGLUA:-build/pglua}
GPUS=$(nvidia-smi -L 2> /dev/null | wc -l)
say "== $GPUS GPU(s)"

say "== pg.cuda.selftest()"
run "$PGLUA" -e 'local pg = require "pipegoose"
  local ok, report = pg.cuda.selftest()
  io.write(report)
  os.exit(ok and 0 or 1)' || failed=1

# A check script on n ranks whose "step k loss v" lines (and "grad_norm"
# figures, where the reference has them) must match a PyTorch reference to
# 1e-5 relative over 10 steps; the comparison in Lua:
#   compare.lua OUTPUT REFERENCE.json LOSSES_KEY NORMS_KEY|-
cat > "$OUT/compare.lua" <<'LUA'
local cjson = require "cjson"
local f = assert(io.open(arg[2]))
local ref = cjson.decode(f:read("a"))
f:close()
f = assert(io.open(arg[1]))
local out = f:read("a")
f:close()
local losses, norms = ref[arg[3]], arg[4] ~= "-" and ref[arg[4]] or nil
local seen, worst = 0, 0
for k, l in out:gmatch("step (%d+) loss (%S+)") do
  k, seen = tonumber(k), seen + 1
  worst = math.max(worst, math.abs(l - losses[k]) / losses[k])
end
-- gpt2_check prints "step k loss v grad_norm n", model_check "grad_norm k n"
for k, g in out:gmatch("step (%d+) loss %S+ grad_norm (%S+)") do
  if norms then worst = math.max(worst, math.abs(g - norms[tonumber(k)]) / norms[tonumber(k)]) end
end
print(("   %d steps, worst relative difference from PyTorch %.3g (tolerance 1e-5)"):format(seen, worst))
os.exit(seen == 10 and worst <= 1e-5 and 0 or 1)
LUA
# check NAME RANKS REFERENCE LOSSES_KEY NORMS_KEY -- COMMAND...
check() {
  local name=$1 n=$2 ref=$3 losses=$4 norms=$5; shift 6
  say "== $name on $n rank(s)"
  local cmd=("$PGLUA" "$@")
  [ "$n" -gt 1 ] && cmd=(scripts/mpirun.sh -np "$n" "${cmd[@]}")
  timeout -k 5 "${CHECK_TIMEOUT:-600}" "${cmd[@]}" > "$OUT/check.out" 2>&1
  local rc=$?
  cat "$OUT/check.out" | tee -a "$LOG"
  "$PGLUA" "$OUT/compare.lua" "$OUT/check.out" "$ref" "$losses" "$norms" 2>&1 | tee -a "$LOG"
  local cmp=${PIPESTATUS[0]}
  [ $rc = 0 ] && [ "$cmp" = 0 ] || { say "   FAILED (exit $rc)"; failed=1; }
}
GPT2=(scripts/gpt2_check.lua spec/fixtures/gpt2_tiny_model.bin spec/fixtures/gpt2_tiny_state.bin --steps=10 --clip=0.05
      --device=cuda)
GPT2_REF=(spec/fixtures/gpt2_tiny_clip_steps.json losses grad_norms)
check "gpt2_check --device=cuda" 1 "${GPT2_REF[@]}" -- "${GPT2[@]}"
check "gpt2_check --device=cuda --tensor=2" 2 "${GPT2_REF[@]}" -- "${GPT2[@]}" --tensor=2
check "gpt2_check --device=cuda --data=2 --zero=1" 2 "${GPT2_REF[@]}" -- "${GPT2[@]}" --data=2 --zero=1
# ZeRO-2 and 3 reduce and gather with NCCL on the data group's stream: a GPU per rank (refused when ranks share one)
if [ "$GPUS" -ge 2 ]; then
  for z in 2 3; do
    check "gpt2_check --device=cuda --data=2 --zero=$z" 2 "${GPT2_REF[@]}" -- "${GPT2[@]}" --data=2 --zero=$z
  done
fi
# LLaMA (GQA, RoPE, RMSNorm, SwiGLU kernels)
LLAMA=(scripts/model_check.lua --hf=spec/fixtures/hf_llama_tiny --tokens=spec/fixtures/hf_llama_tiny/tokens.bin
       --clip=1.8 --device=cuda)
LLAMA_REF=(spec/fixtures/hf_llama_tiny/expected.json step_losses -)
check "model_check --device=cuda (LLaMA)" 1 "${LLAMA_REF[@]}" -- "${LLAMA[@]}"
check "model_check --device=cuda --tensor=2 (LLaMA)" 2 "${LLAMA_REF[@]}" -- "${LLAMA[@]}" --tensor=2

# precision = "bf16" on this GPU (cublasGemmEx): bf16_check_spec's device part, with this build standing in for
# the emulated one: the float64 fixture to 1e-3 and the CPU's bf16 run to 1e-4, one rank, --tensor=2, --data=2
say "== precision bf16 on the device: spec/unit/bf16_check_spec.lua (device part)"
run env PGLUA="$PGLUA" PG_EMU_PGLUA="$PGLUA" "$PGLUA" "${BUSTED:-$(command -v busted || echo /usr/bin/busted)}" \
  --helper=spec/support/helpers.lua --filter="on the emulated device" spec/unit/bf16_check_spec.lua || failed=1

say "== bench_gpu.lua ${BENCH_ARGS:-}"
# shellcheck disable=SC2086
run timeout -k 5 "${BENCH_TIMEOUT:-300}" "$PGLUA" scripts/bench_gpu.lua ${BENCH_ARGS:-} | tee "$OUT/bench.out" || failed=1
if [ -z "${BENCH_ARGS:-}" ] && LD_LIBRARY_PATH=$LD_BEFORE python3 -c 'import torch; assert torch.cuda.is_available()' 2> /dev/null; then
  say "== PyTorch on the same GPU: scripts/bench_torch.py --device cuda --batch 8 --seq-len 1024 --clip 1.0"
  LD_LIBRARY_PATH=$LD_BEFORE run timeout -k 5 "${BENCH_TIMEOUT:-300}" python3 scripts/bench_torch.py --device cuda \
    --batch 8 --seq-len 1024 --clip 1.0 | tee "$OUT/torch.out"
  ours=$(sed -n 's/.*tokens_per_s \([0-9.]*\).*/\1/p' "$OUT/bench.out" | head -n 1)
  theirs=$(sed -n 's/^torch_tokens_per_s \([0-9.]*\)/\1/p' "$OUT/torch.out")
  [ -n "$ours" ] && [ -n "$theirs" ] &&
    say "   pipegoose / PyTorch tokens/s: $(awk -v a="$ours" -v b="$theirs" 'BEGIN { printf "%.3f", a / b }')"
fi

if [ "${TABLE:-1}" = 1 ]; then
  bf16_table "$PGLUA" "${TABLE_SEQS:-1024,2048,4096}" "${TABLE_TOKENS:-16384}" 124m:gpt2-124m llama-1b:llama-1b ||
    failed=1
  # what the tensor-core attention gives: the same GPT-2 124M steps with the float32 core on widened q|k|v
  say "== bf16 GPT-2 124M with PG_FLASH_BF16=0 (the float32 attention core), T 1024 and 4096"
  run env PG_FLASH_BF16=0 timeout -k 5 "${BENCH_TIMEOUT:-900}" "$PGLUA" scripts/bench_gpu.lua --model=124m \
    --precision=bf16 --seqs=1024,4096 --tokens="${TABLE_TOKENS:-16384}" --attention=none || failed=1
fi

if [ "${SPECS:-1}" = 1 ]; then
  say "== the dist specs' device worlds on this GPU"
  BUSTED=${BUSTED:-$(command -v busted || echo /usr/bin/busted)}
  for spec in $(grep -l '^-- device worlds:' spec/dist/*_spec.lua); do
    run env PGLUA="$PGLUA" PG_EMU_PGLUA="$PGLUA" BUSTED="$BUSTED" PG_TEST_ONLY=dist PG_TEST_DEVICE_ONLY=1 PG_DIST_TIMEOUT="${DIST_TIMEOUT:-300}" \
      PG_TEST_FILTER="$(basename "$spec")" scripts/run_tests.sh || failed=1
  done
fi

say "== gpu_check: $([ $failed = 0 ] && echo passed || echo FAILED)"
exit $failed
