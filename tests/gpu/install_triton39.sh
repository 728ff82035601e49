#!/usr/bin/env bash
# Triton 3.9 beside the machine's 3.6, for `TRITON=3.9 bash tests/gpu/run.sh STAGE`: joins the chunks
# staged in /tmp/t39/ (tests/gpu/stage_triton39.sh) in the order of tests/gpu/triton39.sha256, checks the
# wheel's sha256 against it, installs the wheel without dependencies into /tmp/site39, and puts its own
# ptxas (backends/nvidia/bin/ptxas-blackwell, CUDA 13.4) in /tmp/ptxas39/ as `ptxas`, off PATH: jaxlib
# finds the machine's ptxas (CUDA 13.0), and the package asks Triton for PTX that one accepts
# (_compat.ptx_version_option). run.sh puts /tmp/ptxas39 first on PATH with PTXAS39_ON_PATH=1, to compare.
#
#   bash tests/gpu/install_triton39.sh            # from the repository root; PYTHON=python3.12 elsewhere
set -euo pipefail
cd "$(dirname "$0")/../.."
manifest=tests/gpu/triton39.sha256
python=${PYTHON:-python3}
staged=${T39_STAGED:-/tmp/t39}
site=${T39_SITE:-/tmp/site39}
ptxas_dir=${T39_PTXAS:-/tmp/ptxas39}
sha=$(awk '$1 == "sha256" {print $2}' "$manifest")
wheel=$(awk '$1 == "wheel" {print $2}' "$manifest")
parts=()
for chunk in $(awk '$1 == "chunk" {print $2}' "$manifest"); do
  part="$staged/$(basename "$chunk")"
  if [ ! -f "$part" ]; then
    echo "$chunk is not staged in $staged: bash tests/gpu/stage_triton39.sh $(dirname "$chunk")" >&2
    exit 1
  fi
  parts+=("$part")
done
cat "${parts[@]}" > "$staged/$wheel"
echo "$sha  $staged/$wheel" | sha256sum --check --strict
"$python" -m pip install -q --no-index --no-deps --upgrade --target "$site" "$staged/$wheel"
rm "$staged/$wheel"
mkdir -p "$ptxas_dir"
install -m 0755 "$site/triton/backends/nvidia/bin/ptxas-blackwell" "$ptxas_dir/ptxas"
PYTHONPATH="$site" "$python" -c 'import triton; print("triton", triton.__version__, "in", triton.__path__[0])'
"$ptxas_dir/ptxas" --version | tail -2
cat <<MSG
triton 3.9 installed. Run a stage with it: TRITON=3.9 bash tests/gpu/run.sh suite (and PTXAS39_ON_PATH=1 to
put its own ptxas first on PATH), or by hand:
  export PYTHONPATH=$site:/tmp/site:\$PWD
  export PATH=$ptxas_dir:\$PATH      # optional: jaxlib then assembles with CUDA 13.4's ptxas
MSG
