# Shared by the GPU scripts (benchmarks/gpu_smoke.sh, benchmarks/gpu_suite.sh): sourced
# after OUT, RUNS, RESULTS, LOG, PY, DEVICE, PREC, BUDGET_S and DATA (an array) are set.

# The lent GPU machine has no internet and no torchdata (StatefulDataLoader): install the
# wheels carried in .whl/ (when there are any) into a private target instead of touching
# the system site-packages (without pip, unpack them: a pure-Python wheel is a zip).
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl ||
        for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
fi
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1

# merge KEY KIND ARG: put a value into results.json under KEY, read-modify-write, so the
# file holds everything finished so far if the machine stops us mid-way. KIND:
#   train DIR   a summary of DIR/metrics.jsonl    stdout FILE  the first JSON line of FILE
#   file FILE   a JSON file                       value JSON   a literal
cat >/tmp/gpu_smoke_merge.py <<'EOF'
import json, statistics, sys

results_path, key, kind, arg = sys.argv[1:5]

def train_summary(run_dir):
    recs = [json.loads(l) for l in open(f"{run_dir}/metrics.jsonl") if l.strip()]
    recs = [r for r in recs if "loss" in r and "tokens_per_s" in r]
    steady = recs[2:] or recs  # the first steps pay for warm-up, allocation, compilation
    # Expert load per MoE layer, at the run's first step (the routing of its init: "step
    # 0") and at the last logged one: max/mean is the busiest expert's tokens over the
    # mean, from 1 (even) to E/k (every token on the same k experts); starved counts the
    # experts under 10% of the mean load.
    last_load = [r for r in recs if "expert_load_max_over_mean" in r]
    return {
        "steps": len(recs),
        "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"],
        "loss_curve": [[r["step"], round(r["loss"], 4)] for r in recs[:: max(1, len(recs) // 12)]],
        "first_step_s": recs[0]["step_time_s"],
        "median_step_s": statistics.median(r["step_time_s"] for r in steady),
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in recs),
        "mfu": statistics.median(r["mfu"] for r in steady) if steady[0].get("mfu") else None,
        "skipped_steps": recs[-1].get("skipped_steps"),
        "expert_load_max_over_mean": last_load[-1]["expert_load_max_over_mean"] if last_load else None,
        "expert_load_starved": last_load[-1].get("expert_load_starved") if last_load else None,
        "expert_load_step": last_load[-1]["step"] if last_load else None,
        "step1_expert_load_max_over_mean": last_load[0]["expert_load_max_over_mean"] if last_load else None,
        "step1_expert_load_starved": last_load[0].get("expert_load_starved") if last_load else None,
        "aux_loss_last": recs[-1].get("aux_loss"), "z_loss_last": recs[-1].get("z_loss"),
    }

try:
    if kind == "train":
        value = train_summary(arg)
    elif kind == "stdout":
        value = json.loads(next(l for l in open(arg) if l.startswith("{")))
    elif kind == "file":
        value = json.load(open(arg))
    else:
        value = json.loads(arg)
except Exception as err:  # a missing or cut-short file: say so, keep the rest
    value = {"error": f"{type(err).__name__}: {err}"}
results = json.load(open(results_path))
node = results
*parents, leaf = key.split(".")
for p in parents:
    node = node.setdefault(p, {})
node[leaf] = value
json.dump(results, open(results_path, "w"), indent=1)
EOF
merge() { python3 /tmp/gpu_smoke_merge.py "$RESULTS" "$@"; }

# step NAME LIMIT_S CMD...: run CMD under timeout (LIMIT_S or what is left of the budget),
# its output into the log (and into $RUNS/NAME.out for `merge ... stdout`), rc and time
# into results.json; the tail of a failure goes to the console as well.
step() {
    local name=$1 limit=$2 left=$((BUDGET_S - SECONDS))
    shift 2
    ((left < limit)) && limit=$left
    if ((limit < 20)); then
        echo "[$SECONDS s] $name: skipped (budget spent)" | tee -a "$LOG"
        merge "steps.$name" value '{"rc": "skipped"}'
        return 1
    fi
    echo "=== [$SECONDS s] $name (limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" >"$RUNS/$name.out" 2>&1
    local rc=$?
    cat "$RUNS/$name.out" >>"$LOG"
    echo "=== $name: rc $rc in $((SECONDS - start)) s" | tee -a "$LOG"
    ((rc != 0)) && tail -n 15 "$RUNS/$name.out"
    merge "steps.$name" value "{\"rc\": $rc, \"seconds\": $((SECONDS - start)), \"limit_s\": $limit}"
    return $rc
}

# train NAME LIMIT_S CONFIG OVERRIDES...: one single-process train.py run on $DEVICE.
train() {
    local name=$1 limit=$2 config=$3
    shift 3
    step "$name" "$limit" "$PY" train.py --config "$config" --train.device="$DEVICE" \
        --train.mixed_precision="$PREC" --job.output_dir="$RUNS/$name" \
        --metrics.log_interval=1 --metrics.progress=false ${STEPS:+--train.steps=$STEPS} \
        "${DATA[@]}" "$@"
    merge "train.$name" train "$RUNS/$name"
}

