#!/usr/bin/env bash
# The CUDA kernels' self-test (pg_cuda_selftest: every kernels/cuda kernel
# against its CPU kernel) on the CPU, for machines without a GPU.
#
# kernels/cuda/*.cu are compiled as C++ by the host compiler against the
# stand-ins in spec/support/cuda_emu/ (runtime, cuBLAS, NCCL; block threads
# run as fibers with exact barriers), the only change to the source being
# each `kernel<<<config>>>(args)` launch rewritten as a function call.
# src/backend/pg_cuda.c, src/backend/pg_cuda_selftest.c (the self-test itself) and kernels/cpu are compiled as they
# are. This checks the kernels' indexing, reductions, barriers and the cuBLAS
# calls' layouts; not speed, not the device compiler.
#
#   scripts/cuda_emu_test.sh [OUTDIR]     (default build/cuda-emu)
#   EMU_FLAGS="-fsanitize=address"        extra compile and link flags (e.g. to catch
#                                         out-of-bounds accesses in the kernels)
# Prints the self-test report; exit status 0 when every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/cuda-emu}
EMU=spec/support/cuda_emu
CXX=${CXX:-g++}
CC=${CC:-gcc}
mkdir -p "$OUT"
BLAS_CFLAGS=$(pkg-config --cflags openblas)
BLAS_LIBS=$(pkg-config --libs openblas)
EXTRA=(${EMU_FLAGS:-})
COMMON=(-O1 -g -fPIC -ffp-contract=off -DPG_WITH_CUDA=1 -I"$EMU" -Ikernels -Ikernels/cuda -Isrc/runtime -Isrc/backend "${EXTRA[@]}")

pids=()
objs=()
for f in kernels/cuda/*.cu; do
  b=$(basename "$f" .cu)
  sed -E 's/([A-Za-z_][A-Za-z0-9_]*)<<<(.*)>>>\(/pg_emu_launch(\1, \2)(/' "$f" > "$OUT/$b.cpp"
  if grep -n '<<<' "$OUT/$b.cpp"; then
    echo "cuda_emu_test: $f: a launch the rewrite does not understand (write it on one line: kernel<<<...>>>(" >&2
    exit 1
  fi
  objs+=("$OUT/$b.o")
  $CXX -std=c++17 -Wall -Wextra -Wno-unused-parameter "${COMMON[@]}" -c "$OUT/$b.cpp" -o "$OUT/$b.o" &
  pids+=($!)
done
$CXX -std=c++17 -Wall -Wextra "${COMMON[@]}" -c "$EMU/emu.cpp" -o "$OUT/emu.o" &
pids+=($!)
objs+=("$OUT/emu.o")
for f in src/backend/pg_cuda.c src/backend/pg_cuda_selftest.c src/backend/cpu_bf16_gemm.c src/runtime/pg_error.c src/runtime/pg_env.c kernels/cpu/*.c \
  "$EMU/selftest_main.c"; do
  o="$OUT/c_$(basename "$f" .c).o"
  $CC -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -fopenmp -fno-trapping-math -fno-math-errno "${COMMON[@]}" \
    $BLAS_CFLAGS -c "$f" -o "$o" &
  pids+=($!)
  objs+=("$o")
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
[ $status = 0 ] || { echo "cuda_emu_test: compilation failed" >&2; exit 1; }
$CXX -fopenmp "${EXTRA[@]}" -o "$OUT/selftest" "${objs[@]}" $BLAS_LIBS -ldnnl -lm  # -ldnnl: src/backend/cpu_bf16_gemm.c
"$OUT/selftest"
