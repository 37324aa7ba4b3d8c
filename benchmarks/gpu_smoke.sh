#!/usr/bin/env bash
# First contact with a GPU: does training run on CUDA, how fast, how much memory?
#
#   bash benchmarks/gpu_smoke.sh        (on the GPU machine; results under $OUT)
#
# Writes $OUT/log.txt (every command's output) and $OUT/results.json (one object: env,
# per-step rc and seconds, train-run summaries, dry-run plan, benchmark JSON). Each
# training summary holds the routing per MoE layer at the first step (step1_*: the init's
# routing) and at the last logged step: expert_load_max_over_mean is the busiest expert's
# tokens over the mean, 1 when even and E/k when every token goes to the same k experts
# (16 for Qwen3-30B's top-8 of 128: one group of 8 experts takes everything; it does not
# say which); expert_load_starved counts the experts under 10% of the mean load. The GPU
# machine returns at most 8 files, so everything goes into these two. Every step runs
# under `timeout`, capped by what is left of BUDGET_S, so the script ends in time even if
# a step hangs; a failing step is recorded and the next one runs.
#
# Knobs (defaults are for the H100; a CPU dry run of the script itself:
#   OUT=/tmp/gpu_smoke_out PY=.venv/bin/python DEVICE=cpu PREC=fp32 STEPS=3 \
#     PROXY_STEPS=3 TINY=1 bash benchmarks/gpu_smoke.sh):
#   DEVICE (cuda), PREC (bf16), STEPS (empty: the configs' 60 steps), PROXY_LAYERS (4),
#   PROXY_STEPS (12), TINY=1 (CPU-sized proxy and MoE-layer shapes), BUDGET_S (420),
#   PY (python3).

OUT=${OUT:-/tmp/gpu_smoke_out}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
PREC=${PREC:-bf16}
STEPS=${STEPS:-}
PROXY_LAYERS=${PROXY_LAYERS:-4}
PROXY_STEPS=${PROXY_STEPS:-12}
BUDGET_S=${BUDGET_S:-420}
mkdir -p "$OUT"
LOG=$OUT/log.txt
RESULTS=$OUT/results.json
RUNS=/tmp/gpu_smoke_runs # train output dirs: only their summaries go to $OUT
rm -rf "$RUNS" && mkdir -p "$RUNS"
echo '{}' >"$RESULTS"

source benchmarks/gpu_lib.sh

# --- a. environment --------------------------------------------------------------------
step env 60 bash -c "nvidia-smi -L; nvidia-smi; $PY -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|numpy|torchdata) '"
step env_torch 60 "$PY" -c '
import json, torch, torchdata
cuda = torch.cuda.is_available()
print(json.dumps({
    "torch": torch.__version__, "cuda": torch.version.cuda, "torchdata": torchdata.__version__,
    "cuda_available": cuda,
    "device": torch.cuda.get_device_name() if cuda else None,
    "capability": torch.cuda.get_device_capability() if cuda else None,
    "memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
    "grouped_mm": hasattr(torch, "_grouped_mm"),
}))'
merge env stdout "$RUNS/env_torch.out"

# The stdlib corpus needs the interpreter's .py sources; a stripped image has none, then
# train on this repository's own Python files instead.
DATA=()
if (($("$PY" -c 'from moetrain.data.sources import stdlib_files; print(len(stdlib_files()))' 2>/dev/null || echo 0) < 100)); then
    DATA=(--data.source=text "--data.path=$PWD/**/*.py")
    echo "no stdlib sources: training on $PWD/**/*.py" | tee -a "$LOG"
fi
merge data_override value "\"${DATA[*]}\""

# --- b. tests: none of tests/ touches CUDA (grep -l cuda tests/ is empty), so none here --

# --- c. the debug models, eager, on one GPU ------------------------------------------
train qwen3_eager 90 configs/debug_qwen3_moe.toml
train deepseek_v3_eager 90 configs/debug_deepseek_v3.toml
train qwen3_selective 90 configs/debug_qwen3_moe.toml --train.activation_checkpoint=selective

# --- d. Qwen3-30B-A3B at full width, PROXY_LAYERS blocks, seq 4096, micro batch 1 ------
# ~3.1B parameters at 4 blocks; the dry run (same overrides) predicts the peak first.
PROXY_ARGS=(--model.num_hidden_layers="$PROXY_LAYERS" --data.seq_len=4096
    --train.micro_batch_size=1 --train.global_batch_size=1 --train.warmup_steps=2
    --data.max_tokens=2000000)
if [[ -n ${TINY:-} ]]; then # CPU check of the command line only
    PROXY_ARGS+=(--model.hidden_size=128 --model.intermediate_size=256
        --model.moe_intermediate_size=64 --model.num_experts=8 --model.num_experts_per_tok=2
        --model.num_attention_heads=4 --model.num_key_value_heads=2 --model.head_dim=32
        --model.vocab_size=512 --data.seq_len=256)
fi
step proxy_dry_run 60 "$PY" -m moetrain.planner --world-size=1 \
    --config configs/qwen3_30b_a3b.toml --train.device="$DEVICE" \
    --train.mixed_precision="$PREC" "${DATA[@]}" "${PROXY_ARGS[@]}" \
    --gpu-memory=80 --hardware=h100 --json "$RUNS/proxy_plan.json"
merge proxy_dry_run file "$RUNS/proxy_plan.json"
train qwen3_30b_proxy 150 configs/qwen3_30b_a3b.toml --train.steps="$PROXY_STEPS" "${PROXY_ARGS[@]}"

# --- e. the single-process benchmarks ----------------------------------------------------
# moe_layer picks cuda when it is there; bf16 at Qwen3-30B's expert shape, then its default.
MOE_SHAPE=(--tokens=4096 --hidden=2048 --inter=768 --experts=128 --topk=8)
[[ -n ${TINY:-} ]] && MOE_SHAPE=(--tokens=256 --hidden=128 --inter=64 --experts=8 --topk=2)
step moe_layer_30b_shape 60 "$PY" benchmarks/moe_layer.py "${MOE_SHAPE[@]}" --dtype=bf16
merge bench.moe_layer_30b_shape stdout "$RUNS/moe_layer_30b_shape.out"
step moe_layer_default 60 "$PY" benchmarks/moe_layer.py
merge bench.moe_layer_default stdout "$RUNS/moe_layer_default.out"
# step_time: the debug config says device=cpu, fp32: override both; the transformers
# comparison runs where it finds CUDA.
step step_time 120 "$PY" benchmarks/step_time.py --config configs/debug_qwen3_moe.toml \
    --train.device="$DEVICE" --train.mixed_precision="$PREC" --measure=10 "${DATA[@]}"
merge bench.step_time stdout "$RUNS/step_time.out"

# --- c, last: torch.compile, whose first compilation is the slowest and likeliest to hang;
# it gets what is left (selective checkpointing is refused with compile).
train qwen3_compile 180 configs/debug_qwen3_moe.toml --train.compile=true

echo "=== done in $SECONDS s; results:" | tee -a "$LOG"
# The console copy, in case the files do not come back; the dry-run plan only by its peak.
python3 - "$RESULTS" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
plan = r.pop("proxy_dry_run", {})
r["proxy_predicted_peak_gib"] = plan["peak"] / 2**30 if "peak" in plan else plan
print(json.dumps(r, separators=(",", ":")))
EOF
