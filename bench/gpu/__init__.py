"""The prepared GPU check: one command that verifies and measures everything CUDA in Tandem.

    python -m bench.gpu --out DIR [--dry-run] [--budget-s 480]

On the GPU machine, from the repository root, with that machine's python (the device tool's `run`, carrying
bench/gpu/wheels: see bench/gpu/wheels.py). Writes DIR/gpu.json (`parity`, `timings`, `projection`) and
DIR/gpu.md. Correctness first (bench/gpu/parity.py), then costs in the real shapes (bench/gpu/costs.py), then
the projection for the seed's setting (bench/gpu/projection.py). `--dry-run` runs the same code on the CPU
with tiny shapes in seconds (tests/gpu/test_gpu_script.py), so the script does not rot between GPUs.
"""
