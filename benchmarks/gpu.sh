#!/usr/bin/env bash
# The GPU checks and timings in one call (a lent GPU machine has little time): every method on CUDA next
# to CPU, the FedAvg round against a plain loop (sequential and vectorised engines), FedMerge's server
# step against its read-once floor, and each method's round against the GPU's own floor (floor.py).
# Output goes to stdout and, when set, to files under $OUT.
#   bash benchmarks/gpu.sh            # from the repository root, with fedmerge importable
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 benchmarks/device_check.py --device cuda --rounds 2 --out "$OUT/device_check.json" 2>"$OUT/device_check.err" | tee "$OUT/device_check.txt"
python3 benchmarks/sim_efficiency.py --device cuda --model cnn-small --clients 20,200 --batch-size 10,32 --vectorize --repeats 3 | tee "$OUT/sim_efficiency.txt"
python3 benchmarks/fedmerge_server.py --device cuda --repeats 5 | tee "$OUT/fedmerge_server.txt"
python3 benchmarks/fedmerge_server.py --device cuda --repeats 5 --merge-grad head | tee -a "$OUT/fedmerge_server.txt"
python3 benchmarks/floor.py --device cuda --json "$OUT/floor.json" | tee "$OUT/floor.txt"
