#!/usr/bin/env bash
# The GPU checks, run on a lent GPU machine (the workplace's device tool) from the repo root.
# Each stage writes its log and figures to $OUT (default benchmarks/out/gpu), flat (the
# device tool brings back 8 files, 2 folders down). Each call names `carry: [".whl"]`
# (`bash benchmarks/gpu_wheels.sh` fetches the wheels here first) and `OUT=$OUT` in front.
# What fits 15 minutes of device time (a machine's start takes 1-2 of them; measured on an
# H200: the first call 267 s, the second 219 s):
#   bash benchmarks/gpu_check.sh setup tests suite
#   SPACES=gpu_gpt2 SEARCH_S=330 BUDGET=260 bash benchmarks/gpu_check.sh search
# and, in another session, one of:
#   MODELS=gpt2_124m TRUTH_S=320 bash benchmarks/gpu_check.sh setup truth
#   MODELS=resnet50 TRUTH_S=540 bash benchmarks/gpu_check.sh setup truth
#   SPACES=gpu_resnet50 SEARCH_S=510 BUDGET=480 PICK_S=200 bash benchmarks/gpu_check.sh setup search pickbest
#     (the search measured 10 configs in 368 s on an H200, then the pick against the landscape's
#     best took 150 s a round: a whole call of 600 s)
#   LANDSCAPE=gpu_resnet50 LANDSCAPE_S=500 bash benchmarks/gpu_check.sh setup landscape   (again to finish it)
#   LANDSCAPE_S=500 bash benchmarks/gpu_check.sh setup cpu16    (again to finish it)
#   PAIRS_S=400 bash benchmarks/gpu_check.sh setup pairs
#   GC_S=360 bash benchmarks/gpu_check.sh setup gc
# then, here, with the files copied into benchmarks/out/gpu/: python benchmarks/gpu_collect.py
# && python benchmarks/render.py. `setup` installs the carried wheels in .whl/ when there is
# no Ray on the machine: Ray's wheel is over the tool's 64 MiB, so it travels as
# ray.tar.xz without its Java jars, RLlib, Serve, LLM and dashboard UI.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/site/ray ] && ! python3 -c "import ray" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  [ -f .whl/ray.tar.xz ] && tar xJf .whl/ray.tar.xz -C /tmp/site
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    setup)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c "import torch, ray, optuna; print('torch', torch.__version__, 'ray', ray.__version__, 'optuna', optuna.__version__, 'cuda', torch.cuda.is_available())"
      python3 -m tuner doctor 2>&1 | tee "$OUT/doctor.log"
      # SMT: PyTorch's own default intra-op threads (physical cores, where there are fewer
      # than logical ones) against the cores a trial gets by default (the logical ones)
      { lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket)"; env -u OMP_NUM_THREADS -u MKL_NUM_THREADS python3 -c \
        "import torch, joblib; print('torch default threads', torch.get_num_threads(), 'usable cores', joblib.cpu_count())"; \
      } 2>&1 | tee "$OUT/threads.log" ;;
    tests)
      python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log" ;;
    search)  # each space in SPACES; results kept outside $OUT, the records copied in
      for space in ${SPACES:-gpu_gpt2 gpu_resnet50}; do
        rm -rf "/tmp/results/$space"
        timeout "${SEARCH_S:-280}" python3 -m tuner run "search_spaces/$space.yaml" --time-budget "${BUDGET:-200}" \
          --results-dir /tmp/results --quiet 2>&1 | tee "$OUT/${space}_search.log"
        cp "/tmp/results/$space/trials.jsonl" "$OUT/${space}_trials.jsonl"
        cp "/tmp/results/$space/summary.json" "$OUT/${space}_summary.json" 2>/dev/null
        cp "/tmp/results/$space/space.yaml" "$OUT/${space}_space.yaml" 2>/dev/null  # the budget it ran under
        python3 -m tuner show "/tmp/results/$space" >> "$OUT/${space}_search.log" 2>&1
      done ;;
    pickbest)  # each searched space's pick against its landscape's best config, side by side (after `search`)
      out=$(cd "$OUT" && pwd)
      for space in ${SPACES:-gpu_resnet50}; do
        (cd benchmarks && timeout "${PICK_S:-300}" python3 pick_vs_best.py --results "/tmp/results/$space" \
          --landscape "$space" --space "../search_spaces/$space.yaml" --rounds "${ROUNDS:-2}" \
          --deadline-s "$(( ${PICK_S:-300} - 10 ))" --out "$out/${space}_pick_vs_best.json") 2>&1 | tee "$OUT/${space}_pick_vs_best.log"
      done ;;
    truth)  # bench against a plain loop on GPT-2 124M and ResNet-50, interleaved
      m=${MODELS:-gpt2_124m,resnet50}
      timeout "${TRUTH_S:-560}" python3 benchmarks/gpu_truth.py --models "$m" --rounds "${ROUNDS:-2}" \
        ${PICK:+--pick $PICK} --epochs "${EPOCHS:-3}" --out "$OUT/gpu_truth_${m//,/_}.json" 2>&1 | tee "$OUT/gpu_truth_${m//,/_}.log" ;;
    sleepy)  # a known 50 ms step on the GPU: what the loop adds around it
      python3 -c "
from tests.helpers import FAST_MEASURE, ref
from tuner.trial import make_request, run_isolated
if __name__ == '__main__':
    r = run_isolated(make_request(workload=ref('sleepy'), workload_args={'step_s': 0.05},
        config={'micro_batch_size': 4}, device='cuda', measure=FAST_MEASURE), timeout_s=120)
    print({k: r.get(k) for k in ('samples_per_sec', 'steady_samples_per_sec', 'step_time_ms', 'epoch_overhead_s',
        'epoch_starts_measured', 'window_steps', 'windows', 'samples_per_sec_windows', 'data_wait_fraction')})
" 2>&1 | tee "$OUT/sleepy.log" ;;
    landscape)  # a GPU landscape for the search replay: record (resumes a partial file), then repeat
      ls=${LANDSCAPE:-gpu_resnet50}
      timeout "${LANDSCAPE_S:-500}" bash -c "python3 benchmarks/search_replay.py record benchmarks/landscapes/$ls.yaml \
        --repeats 2 && python3 benchmarks/search_replay.py repeat benchmarks/landscapes/$ls.yaml" 2>&1 | tee "$OUT/$ls.log"
      cp "benchmarks/landscapes/$ls.json" "$OUT/" ;;
    pairs)  # the hot-path defects and the input pipeline's knobs on the GPU, interleaved pairs
      timeout "${PAIRS_S:-400}" bash -c "python3 benchmarks/hotpath_pairs.py --device cuda --rounds 2 --out $OUT/hotpath_pairs_gpu.json \
        && python3 benchmarks/cache_pairs.py --device cuda --augment --rounds 2 --out $OUT/augment_pairs_gpu.json" 2>&1 | tee "$OUT/pairs.log" ;;
    gc)  # gc_freeze off and on, bench and the plain loop, on a table read in large batches
      timeout "${GC_S:-360}" python3 benchmarks/knob_ab.py --device cuda --knob gc_freeze --workloads rows \
        --set 'precision="bf16"' --rounds "${ROUNDS:-2}" --epochs 2 --out "$OUT/knob_ab_gc_freeze_gpu.json" 2>&1 | tee "$OUT/gc_pair.log" ;;
    cpu16)  # a landscape of the machine's own CPUs (16 cores): threads and workers beyond 2
      timeout "${LANDSCAPE_S:-500}" bash -c "python3 benchmarks/search_replay.py record benchmarks/landscapes/conv_cpu16.yaml \
        --repeats 2 --held-out" 2>&1 | tee "$OUT/conv_cpu16.log"
      cp benchmarks/landscapes/conv_cpu16.json "$OUT/" ;;
    suite)
      python3 -m pytest -q -x -p no:cacheprovider -m "not slow" 2>&1 | tee "$OUT/suite.log" ;;
  esac
done
