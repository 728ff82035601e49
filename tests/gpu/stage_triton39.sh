#!/usr/bin/env bash
# Stage one chunk of the triton 3.9 wheel on the GPU machine: copies the chunk that CHUNK_DIR (a folder
# of tests/gpu/triton39.sha256, carried by this device call) holds into /tmp/t39/, and says which chunks
# are still to stage. When none is, run tests/gpu/install_triton39.sh.
#
#   bash tests/gpu/stage_triton39.sh .t39a        # from the repository root
set -euo pipefail
cd "$(dirname "$0")/../.."
folder=${1:?usage: bash tests/gpu/stage_triton39.sh CHUNK_DIR (e.g. .t39a)}
staged=${T39_STAGED:-/tmp/t39}
chunks=$(awk '$1 == "chunk" {print $2}' tests/gpu/triton39.sha256)
found=0
mkdir -p "$staged"
for chunk in $chunks; do
  if [ "$(basename "$(dirname "$chunk")")" = "$(basename "$folder")" ]; then
    [ -f "$folder/$(basename "$chunk")" ] || { echo "no $(basename "$chunk") in $folder" >&2; exit 1; }
    cp "$folder/$(basename "$chunk")" "$staged/"
    found=1
    echo "staged $chunk ($(stat -c %s "$staged/$(basename "$chunk")") bytes)"
  fi
done
[ "$found" = 1 ] || { echo "$folder is not a chunk folder of tests/gpu/triton39.sha256" >&2; exit 1; }
missing=""
for chunk in $chunks; do
  [ -f "$staged/$(basename "$chunk")" ] || missing="$missing $chunk"
done
echo "still to stage:${missing:- none: run bash tests/gpu/install_triton39.sh}"
