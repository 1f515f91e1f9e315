#!/usr/bin/env bash
# Batch and sequence length together (docs/predict.md, "Two dimensions"):
# each language-model job of bench/torch/predict_jobs.py recorded on the
# GPU at batch 2 and 4 for sequence lengths 128, 256 and 512, predicted at
# TARGET_BATCH x the job's TARGET length in two passes of `gpumem predict`
# (each length at the batch, with --write-trace; then those traces over the
# lengths), and run there under native PyTorch, expandable segments and
# gpumem. Prints predicted against measured peak reserved per allocator.
#
#   bash bench/torch/predict_seq.sh OUTDIR [JOB:LENGTH ...]   (default: gpt2:1024 llama:2048)
#
# TARGET_BATCH (default 16), PARALLEL processes at once (default 6).
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" ""
need_library predict_seq.sh
out="${1:?usage: predict_seq.sh OUTDIR [JOB:LENGTH ...]}"
shift
[ $# -eq 0 ] && set -- gpt2:1024 llama:2048
batch="${TARGET_BATCH:-16}"
lengths="128 256 512"
gpumem="$build/gpumem"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
# the first gpumem run compiles its PyTorch shim: once, before the rest
"$py" -c "import gpumem.torch; gpumem.torch.enable(); import torch; torch.empty(1, device='cuda')" \
  >"$out/shim.log" 2>&1
for jl in "$@"; do
  j=${jl%:*} L=${jl#*:}
  for b in 2 4; do
    for l in $lengths; do
      d="$out/rec/${j}_b${b}_l$l"
      mkdir -p "$d"
      echo "\"$py\" -m gpumem.predict._child gpu \"$d\" 3 h200 \"$root/bench/torch/predict_jobs.py\" $j --batch-size $b --seq-len $l --steps 3 >\"$d/log\" 2>&1"
    done
  done
  for a in native expandable gpumem; do
    echo "\"$py\" \"$root/bench/torch/predict_jobs.py\" $j --batch-size $batch --seq-len $L --allocator $a --steps 3 --json \"$out/${j}_$a.json\" >\"$out/${j}_$a.log\" 2>&1"
  done
done | xargs -P "${PARALLEL:-6}" -I{} sh -c '{}'
for jl in "$@"; do
  j=${jl%:*} L=${jl#*:}
  traces=""
  for l in $lengths; do
    r="$out/rec/${j}_b"
    "$gpumem" predict --sizes 2,4 "${r}2_l$l/trace" "${r}4_l$l/trace" --batch "$batch" \
      --write-trace "$out/${j}_b${batch}_l$l.trace" >/dev/null || exit 1
    traces="$traces $out/${j}_b${batch}_l$l.trace"
  done
  # shellcheck disable=SC2086
  "$gpumem" predict --sizes "${lengths// /,}" $traces --batch "$L" --json >"$out/${j}_predicted.json" || exit 1
  "$py" - "$out" "$j" "$batch" "$L" <<'PY'
import json, os, sys
out, job, batch, length = sys.argv[1:]
rows = {r["allocator"]: r for r in json.load(open(os.path.join(out, job + "_predicted.json")))["allocators"]}
for name, row in (("native", "pytorch"), ("expandable", "pytorch expandable"), ("gpumem", "gpumem default")):
    measured = json.load(open(os.path.join(out, "%s_%s.json" % (job, name))))["peak_reserved"]
    predicted = rows[row]["peak_reserved_bytes"]
    print("%s at %s x %s, %-10s predicted %8.3f GiB, measured %8.3f GiB (%+.2f%%)" % (
        job, batch, length, name, predicted / 2**30, measured / 2**30, 100.0 * (predicted - measured) / measured))
PY
done
