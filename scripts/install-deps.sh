#!/usr/bin/env bash
# Installs the Debian packages pipegoose needs, when missing. Safe to re-run:
# it only calls apt-get when something is absent.
set -euo pipefail

PKGS=(
  gcc make pkg-config
  g++                                          # the CUDA kernels run on the CPU emulator (scripts/cuda_emu_test.sh)
  lua5.4 liblua5.4-dev lua-busted lua-cjson   # interpreter headers, test runner, JSON
  libopenmpi-dev openmpi-bin                   # MPI
  libopenblas-openmp-dev                       # sgemm (OpenMP flavour: one thread pool with ours)
  libdnnl-dev                                  # oneDNN: bf16 GEMMs (AVX512_BF16 / AMX)
  zlib1g-dev                                   # crc32 for checkpoint checksums
  libpcre2-dev libutf8proc-dev                 # tokenizers: pre-tokenizer regexes (PCRE2, JIT), NFC/NFKC (utf8proc)
  fortunes                                     # make run's corpus: the fortunes (/usr/share/games/fortunes)
  bible-kjv bible-kjv-text                     # ... and the King James Bible (the bible command; make run)
  wamerican                                    # /usr/share/dict/words: the dictionary make run's sample is checked against
  lua-argparse                                 # command-line options of the examples and scripts
  gnuplot-nox                                  # scripts/plot.lua
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then SUDO=(); elif command -v sudo >/dev/null; then SUDO=(sudo); else
  echo "install-deps: need root to install: ${missing[*]}" >&2; exit 1; fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
