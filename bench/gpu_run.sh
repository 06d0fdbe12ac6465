#!/usr/bin/env bash
# One call on the offline H200 machine: install guardlint, unpack the FlashInfer bundle (.gpu-deps, made by
# ../shared/gpu/make_flashinfer_bundle.sh), then run the named steps and pack results + logs into $OUT.
#   bash bench/gpu_run.sh tests tests-flashinfer tests-gluon engines lora-tests lora eager eager-profile anatomy guard
#   attention-eager attention-causal attention-anatomy attention-quick attention transformers-train
# The engines step needs einops in .gpu-deps/wheels and the engine sources it loads carried (.engines/...).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
# Step logs go to $LOGS (default /tmp/logs); LOGS=$OUT brings each one back even when the call runs out of time.
LOGS=${LOGS:-/tmp/logs}
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation . >"$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; exit 1; }
if [ -d .gpu-deps ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu-deps/wheels/*.whl >/dev/null 2>&1
  python3 -c "import tarfile; tarfile.open('.gpu-deps/flashinfer.tar.xz').extractall('/tmp/site')"
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=12
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
rc=0
# Each step's new or changed result files are copied to $OUT/results at once, so a call that runs out of time
# still brings back what its finished steps wrote.
step() { name=$1; shift; echo "=== $name: $*"; start=$(date +%s); touch /tmp/.step-start; timeout "${STEP_TIMEOUT:-300}" "$@" 2>&1 | tee "$LOGS/$name.log"; r=${PIPESTATUS[0]}; echo "=== $name: exit $r in $(( $(date +%s) - start )) s"; [ "$r" = 0 ] || rc=1; mkdir -p "$OUT/results"; find bench/results -type f -newer /tmp/.step-start -exec cp {} "$OUT/results/" \; ; }
for s in "$@"; do
  case $s in
    # FlashInfer JIT-compiles each kernel on first use (FA2 ~21 s, FA3 ~83 s a head dim on a fresh machine):
    # its tests run in their own step with room for that, so the others never wait behind a build.
    # About 330 s on a fresh machine since the causal Gluon tests: its own limit, above the 300 s default.
    tests) STEP_TIMEOUT=${TESTS_TIMEOUT:-420} step tests python3 -m pytest -q -m gpu -p no:cacheprovider -k "not flashinfer" tests/kernels/test_attention_gpu.py tests/guard/test_guard_vit.py ;;
    tests-flashinfer) STEP_TIMEOUT=${FI_TIMEOUT:-540} step tests-flashinfer python3 -m pytest -q -m gpu -p no:cacheprovider -k flashinfer tests/kernels/test_attention_gpu.py tests/guard/test_guard_vit.py ;;
    lora) step lora python3 bench/lora.py --write ;;
    # The adversarial GPU suites: hints the guard did not verify, LoRA metadata of every shape.
    tests-hint) step tests-hint python3 -m pytest -q -m gpu -p no:cacheprovider ${HINT_TESTS:-tests/kernels/test_attention_hint_gpu.py} ;;
    tests-adversarial) step tests-adversarial python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_attention_hint_gpu.py tests/kernels/test_lora_adversarial_gpu.py ;;
    # The kernels of an earlier revision (.base, from bench/kernel_regression.py --extract REV) beside today's.
    regression) STEP_TIMEOUT=420 step regression python3 bench/kernel_regression.py --base .base --write ;;
    # The Triton forward on verified and unverified hints beside the kernel that trusted its hint (--extract 03e9d41638).
    regression-hint) step regression-hint python3 bench/kernel_regression.py --base .base --attention-only --rounds 7 --name kernel_regression_hint --write ;;
    # What the launch after an unverified hint costs, against an empty kernel (bench/attention_hint_launch.py).
    hint-launch) step hint-launch python3 bench/attention_hint_launch.py --write ;;
    regression-lora) step regression-lora python3 bench/kernel_regression.py --base .base --lora-only --rounds 9 ;;
    # The guard's host cost per call with every tensor on the GPU.
    guard-overhead) step guard-overhead python3 bench/guard_overhead.py --device cuda --batches 200 --write ;;
    # The Triton backward: its GPU tests, then forward + backward beside torch's varlen flash.
    tests-backward) step tests-backward python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_attention_backward_gpu.py ;;
    attention-backward-tune) STEP_TIMEOUT=${TUNE_TIMEOUT:-420} step attention-backward-tune python3 bench/attention_backward_tune.py --write ;;
    attention-backward) STEP_TIMEOUT=420 step attention-backward python3 bench/attention_backward.py --write --write-dispatch --rounds ${ROUNDS:-7} ;;
    # One training step of the Qwen2.5-VL-7B vision tower per implementation (bench/transformers_vision.py --train):
    # transformers' wheels (.gpu-deps/transformers, bench/make_transformers_bundle.sh) go to /tmp/site first.
    transformers-train)
      if [ -d .gpu-deps/transformers ]; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-deps/transformers/*.whl >"$LOGS/transformers-install.log" 2>&1 || cat "$LOGS/transformers-install.log"
      fi
      PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} STEP_TIMEOUT=420 step transformers-train python3 bench/transformers_vision.py --train --write ;;
    # One pair, six timers (bench/timer_agreement.py): which figures another harness can repeat.
    timer-agreement) STEP_TIMEOUT=${TIMER_TIMEOUT:-420} step timer-agreement python3 bench/timer_agreement.py --write ;;
    engines) step engines python3 -m pytest -q -m gpu -p no:cacheprovider tests/engines/test_engines_gpu.py ;;
    lora-tests) step lora-tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_lora_gpu.py ;;
    eager) step eager python3 bench/lora_eager.py --write ;;
    attention-eager) STEP_TIMEOUT=420 step attention-eager python3 bench/attention_eager.py --write ;;
    eager-profile) step eager-profile python3 bench/lora_eager.py --profile ;;
    sweep) step sweep python3 bench/lora_sweep.py --write ;;
    anatomy) step anatomy python3 bench/lora_anatomy.py --write ;;
    tests-rev) step tests-rev python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 tests/guard/test_guard_vit.py tests/kernels/test_attention_gpu.py ;;
    guard) step guard python3 bench/guard_sync.py --write ;;
    # The Gluon kernels alone (D=64/128 and the two-part D=80/96): their GPU tests, direct launches included.
    tests-gluon) step tests-gluon python3 -m pytest -q -m gpu -p no:cacheprovider -k "gluon or compile or auto" tests/kernels/test_attention_gpu.py ;;
    # The causal cases alone, side by side (printed, nothing written).
    attention-causal) step attention-causal python3 bench/attention.py --cases 6img-d128-causal,6img-d80-causal --budget "${ATTN_BUDGET:-300}" ;;
    # Where the Gluon kernels' time goes: probes with one ingredient stripped, beside FA3 (bench/attention_anatomy.py).
    attention-anatomy) STEP_TIMEOUT=360 step attention-anatomy python3 bench/attention_anatomy.py --write ;;
    attention-quick) step attention-quick python3 bench/attention.py --quick --no-flashinfer --budget 200 --write ;;
    attention) STEP_TIMEOUT=$(( ${ATTN_BUDGET:-480} + 40 )) step attention python3 bench/attention.py --write-dispatch --write --budget "${ATTN_BUDGET:-480}" ;;
    *) echo "unknown step $s"; rc=1 ;;
  esac
done
tar czf "$OUT/results.tgz" bench/results kernels/attention/attention_dispatch.json "$LOGS"/*.log 2>/dev/null || tar czf "$OUT/results.tgz" bench/results
exit $rc
