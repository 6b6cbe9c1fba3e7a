#!/usr/bin/env bash
# Puts the CIFAR-10 data this workplace has (../shared/data/cifar10: the first 4,000 training and 1,000 test images
# of the official binary files, xz-compressed) into .data/cifar10 under the official names, for a GPU machine
# that cannot see ../shared: data_batch_1.bin holds the 4,000 images (data_batch_2..5.bin are left out: the loader
# trains on the batches present and says which are missing, and refuses an empty file as a failed copy),
# test_batch.bin the 1,000 test images. About 15 MB; .data/ is git-ignored.
#
#   tools/pack_gpu_data.sh [SHARED_DATA_DIR]
#   run: carry [".deps", ".data"], command "TRAIN=1 CIFAR_DIR=.data/cifar10 bash tools/gpu_check.sh"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
src=${1:-../shared/data}/cifar10
out=.data/cifar10
for f in data_batch_1_first4000.bin.xz test_batch_first1000.bin.xz; do
  [[ -f $src/$f ]] || { echo "pack_gpu_data: $src/$f not found" >&2; exit 1; }
done
mkdir -p "$out"
xz -dc "$src/data_batch_1_first4000.bin.xz" > "$out/data_batch_1.bin.tmp" && mv "$out/data_batch_1.bin.tmp" "$out/data_batch_1.bin"
xz -dc "$src/test_batch_first1000.bin.xz" > "$out/test_batch.bin.tmp" && mv "$out/test_batch.bin.tmp" "$out/test_batch.bin"
rm -f "$out"/data_batch_{2,3,4,5}.bin  # the empty stand-ins an earlier version wrote
echo "pack_gpu_data: $(du -sh "$out" | cut -f1) in $out ($(($(stat -c %s "$out/data_batch_1.bin") / 3073)) training and" \
     "$(($(stat -c %s "$out/test_batch.bin") / 3073)) test images)"
