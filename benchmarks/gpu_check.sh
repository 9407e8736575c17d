#!/usr/bin/env bash
# The GPU checks, run on a lent GPU machine (the workplace's device tool) from the repo root:
#   bash benchmarks/gpu_check.sh setup tests search truth suite
# Each stage writes its log to $OUT (default benchmarks/out/gpu). `setup` installs the
# carried wheels in .whl/ (Ray, Optuna and what they need beyond the machine's image) when
# there is no Ray on the machine.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import ray" 2>/dev/null; then
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
      python3 -m tuner doctor 2>&1 | tee "$OUT/doctor.log" ;;
    tests)
      python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log" ;;
    search)
      python3 -m tuner bench search_spaces/gpu.yaml --json 2>&1 | tail -1 > "$OUT/bench_default.json"
      timeout "${SEARCH_S:-400}" python3 -m tuner run search_spaces/gpu.yaml --trials "${TRIALS:-8}" --results-dir "$OUT/results" --quiet 2>&1 \
        | tee "$OUT/search.log"
      cp "$OUT/results/gpu/trials.jsonl" "$OUT/gpu_trials.jsonl"; cp "$OUT/results/gpu/summary.json" "$OUT/gpu_summary.json"
      python3 -m tuner show "$OUT/results/gpu" 2>&1 | tee "$OUT/show.log" ;;
    truth)
      python3 benchmarks/truth.py --device cuda --rounds "${ROUNDS:-2}" --epochs 2 --search-rounds 1 \
        --out "$OUT/truth-cuda.json" 2>&1 | tee "$OUT/truth.log" ;;
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
    suite)
      python3 -m pytest -q -x -p no:cacheprovider -m "not slow" 2>&1 | tee "$OUT/suite.log" ;;
  esac
done
