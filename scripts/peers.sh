#!/bin/sh
# The peers `make bench` compares with beyond Debian's PyTorch 1.13: PyTorch
# 2.x from PyPI (MKL, oneDNN, fused AdamW, torch.compile), in a virtual
# environment under build/peers. Run once; `make bench` uses it when it is
# there. Neither CI nor `make test` needs it (it is ~5 GB: PyPI's torch
# wheel brings its CUDA libraries along).
#   scripts/peers.sh            # create or keep build/peers
#   PEERS_TORCH='torch==2.5.1' scripts/peers.sh
set -eu
dir=build/peers
spec=${PEERS_TORCH:-torch>=2.4,<3}
if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c 'import torch' 2>/dev/null; then
  echo "peers: $dir has PyTorch $("$dir/bin/python" -c 'import torch; print(torch.__version__)')"
  exit 0
fi
command -v gcc > /dev/null || { echo "peers: torch.compile needs a C compiler (apt-get install gcc)" >&2; exit 1; }
/usr/bin/python3 -m venv "$dir"
"$dir/bin/pip" install --quiet "$spec" numpy
echo "peers: $dir has PyTorch $("$dir/bin/python" -c 'import torch; print(torch.__version__)')"
