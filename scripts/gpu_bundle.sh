#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs on a GPU machine that has the CUDA
# toolkit but none of this project's Debian packages (Lua, Open MPI, OpenBLAS,
# lua-cjson, busted): the CUDA build of pglua and the files of every Debian
# package it, mpirun and busted load, copied from this machine and packed
# into .gpu/bundle.tar.xz (ignored by git; carry .gpu, about 20 MB). CUDA's own
# libraries (cudart, cuBLAS, NCCL) are not packed: the GPU machine's are found
# at run time (env.sh).
#
#   scripts/gpu_bundle.sh            # here, after make CUDA=1 all
#   tar -xJf .gpu/bundle.tar.xz -C .gpu && . .gpu/env.sh &&
#     BUILD_DONE=1 PGLUA=.gpu/bin/pglua scripts/gpu_check.sh                  # there
#
# The packages are relocated (nothing is unpacked into /): env.sh sets
# LD_LIBRARY_PATH, PATH, LUA_PATH/LUA_CPATH and Open MPI's OPAL_PREFIX to the
# copy. glibc, libstdc++, libgcc and zlib are the GPU machine's own.
set -euo pipefail
cd "$(dirname "$0")/.."
PGLUA=${PGLUA:-build/pglua}
[ -x "$PGLUA" ] || { echo "gpu_bundle.sh: no $PGLUA; run make CUDA=1 all first" >&2; exit 1; }
ldd "$PGLUA" | grep -q libcudart || { echo "gpu_bundle.sh: $PGLUA was built without CUDA (make CUDA=1 all)" >&2; exit 1; }
grep -qx '/.gpu/' .git/info/exclude 2> /dev/null || echo '/.gpu/' >> .git/info/exclude
S=build/gpu-bundle
rm -rf .gpu "$S"
mkdir -p .gpu "$S/bin" "$S/root"

# The ELF files whose shared libraries must come along.
multiarch=$(gcc -print-multiarch)
libdir=/usr/lib/$multiarch
elfs=("$PGLUA" "$(readlink -f "$(command -v mpirun)")" /usr/bin/orted "$libdir"/openmpi/lib/openmpi3/*.so
      "$libdir"/pmix2/lib/pmix/*.so "$libdir"/lua/5.4/*.so "$libdir"/lua/5.4/*/*.so)
packages=(openmpi-bin openmpi-common libopenmpi3 lua-busted lua-cjson)
# busted's Lua dependencies (pure Lua ones have no ELF files to follow)
packages+=($(apt-cache depends --no-recommends --no-suggests lua-busted | sed -n 's/^ *Depends: \(lua-[a-z0-9-]*\)$/\1/p'))
packages+=(lua-luassert lua-say lua-penlight lua-mediator lua-dkjson lua-cliargs)
for f in "${elfs[@]}"; do
  [ -e "$f" ] || continue
  for lib in $(ldd "$f" 2> /dev/null | awk '/=> \//{print $3}'); do
    case "$lib" in /usr/local/cuda*) continue ;; esac
    pkg=$(dpkg -S "$(readlink -f "$lib")" 2> /dev/null | head -n 1 | cut -d: -f1) ||
      pkg=$(dpkg -S "$lib" 2> /dev/null | head -n 1 | cut -d: -f1) || true
    [ -n "$pkg" ] && packages+=("$pkg")
  done
done
# the GPU machine's own: replacing these would break its programs
skip=' libc6 libgcc-s1 libstdc++6 zlib1g '
mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort -u)
for pkg in "${packages[@]}"; do
  [[ $skip == *" $pkg "* ]] && continue
  { dpkg -L "$pkg" 2> /dev/null || echo "gpu_bundle.sh: $pkg is not installed" >&2; } | while read -r f; do
    case "$f" in /usr/share/doc/* | /usr/share/man/* | /usr/share/lintian/*) continue ;; esac
    if [ -f "$f" ] || [ -L "$f" ]; then
      mkdir -p "$S/root$(dirname "$f")"
      cp -a "$f" "$S/root$f"
    fi
  done
  echo "$pkg" >> "$S"/packages
done
# the alternatives links (mpirun -> /etc/alternatives -> mpirun.openmpi; libopenblas.so.0)
for link in /usr/bin/mpirun /usr/bin/mpiexec "$libdir"/libopenblas.so.0 "$libdir"/libblas.so.3 "$libdir"/liblapack.so.3; do
  [ -e "$link" ] || continue
  target=$(readlink -f "$link")
  mkdir -p "$S/root$(dirname "$link")"
  ln -sfn "$(realpath --relative-to="$(dirname "$link")" "$target")" "$S/root$link"
done
cp "$PGLUA" "$S"/bin/pglua

cat > "$S"/env.sh << ENV
# sourced on the GPU machine from the repository root (see scripts/gpu_bundle.sh)
G=\$PWD/.gpu/root
L=\$G/usr/lib/$multiarch
cuda_dirs=
for lib in libcudart.so.13 libcublas.so.13 libnccl.so.2; do
  d=\$( (ldconfig -p | awk -v l=\$lib '\$1 == l {print \$NF; exit}'; find /usr/local/cuda*/ /usr/lib /opt /usr/local/lib -name "\$lib" 2> /dev/null) | head -n 1)
  [ -n "\$d" ] && cuda_dirs=\$cuda_dirs:\$(dirname "\$d")
done
export LD_LIBRARY_PATH=\$L:\$L/openblas-openmp:\$L/openmpi/lib\$cuda_dirs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
export PATH=\$G/usr/bin:\$PATH
export OPAL_PREFIX=\$G/usr OPAL_LIBDIR=\$L/openmpi/lib OPAL_PKGDATADIR=\$G/usr/share/openmpi
export PMIX_PREFIX=\$L/pmix2 PMIX_LIBDIR=\$L/pmix2/lib PMIX_PKGLIBDIR=\$L/pmix2/lib/pmix PMIX_DATADIR=\$L/pmix2/share PMIX_PKGDATADIR=\$L/pmix2/share/pmix
export HWLOC_PLUGINS_PATH=\$L/hwloc
export OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1 OMPI_MCA_mtl=^ofi,psm,psm2 OMPI_MCA_btl_vader_single_copy_mechanism=none
export LUA_PATH="\$G/usr/share/lua/5.4/?.lua;\$G/usr/share/lua/5.4/?/init.lua;./?.lua;;"
export LUA_CPATH="\$L/lua/5.4/?.so;;"
export PIPEGOOSE_LUA_DIR=\$PWD/lua PGLUA=\$PWD/.gpu/bin/pglua
echo "env.sh: CUDA libraries from \${cuda_dirs#:}"
ENV
# LAPACK is not used
rm -f "$S/root/usr/lib/$multiarch"/openblas-openmp/liblapack*
tar -C "$S" -cJf .gpu/bundle.tar.xz .
echo "gpu_bundle.sh: $(wc -l < "$S/packages") packages, .gpu/bundle.tar.xz $(du -h .gpu/bundle.tar.xz | cut -f1)"
