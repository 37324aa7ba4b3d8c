#!/usr/bin/env bash
# Everything that needs a GPU, in parts of under 10 minutes each (one device call a part):
#
#   bash benchmarks/gpu_suite.sh PART...   run the parts in order:
#     tests          pytest -m gpu tests/test_gpu.py (CUDA kernels against plain attention)
#     step           pytest -m gpu tests/test_gpu_step.py (the trainer's step on CUDA: no
#                    sync while queued, fused AdamW's skip, fused against foreach)
#     attention      benchmarks/attention_kernels.py (ring blocks 4k-32k, core 8k-32k)
#     flex_training  debug GPT-OSS with document masks: eager, selective, compiled
#     proxy          Qwen3-30B-A3B proxy: the planner's peak, then training (PROXY_MODES)
#     gemm           GEMM rates by shape (benchmarks/gemm_rates.py), MoE host syncs
#     titan          the proxy against torchtitan's Qwen3 MoE (benchmarks/vs_torchtitan.py):
#                    eager, compiled, and 8 micro-batches a step
#     balance        the proxy's routing: aux loss pooled over layers against per layer,
#                    and per layer with the z-loss (BALANCE_STEPS 60, BALANCE_AUX weights,
#                    BALANCE_VARIANTS)
#     lora           the proxy with LoRA (its plan, then training) and with full fine-tuning
#     flash_attn     flash-attn-4 (parallel.cp_kernel=flash_attn): its cases in tests/test_gpu.py
#                    (-k flash_attn), benchmarks/attention_kernels.py at 8k-32k against SDPA's
#                    flash and cuDNN ops and flex (ring blocks; cores causal and with
#                    documents), and 20 steps of debug GPT-OSS with documents, windows and
#                    sinks through it; under 9 minutes (BUDGET_S).
#                    Installed from the carried .whl/ (its gpu_install.sh; the CuTe DSL's
#                    CUDA 13 wheel comes in two halves, .fa1/ and .fa2/), two calls:
#                      carry .whl .gpu .fa1: bash .whl/gpu_install.sh stash
#                      carry .whl .gpu .fa2: bash .whl/gpu_install.sh install &&
#                        PY=/tmp/venv/bin/python bash benchmarks/gpu_suite.sh flash_attn
#                    (its commands run with PYTHONPATH=$PWD: the venv holds the package, whose
#                    CuTe DSL a .pth file puts on the path). NOTE: .whl/ must hold
#                    nvidia-cutlass-dsl-libs-core==4.8.1 too (cutlass.cute; libs-base
#                    requires it): `pip download --no-deps --python-version 3.12 --platform
#                    manylinux_2_28_x86_64 --only-binary=:all: -d .whl
#                    nvidia-cutlass-dsl-libs-core==4.8.1`.
#     fp8            the proxy in FP8 against bf16 (FP8_RECIPES none,rowwise,tensorwise;
#                    FP8_MODES eager,compile), step times and losses compared
#                    (benchmarks/fp8_speed.py); FP8_CONFIG and FP8_ARGS replace the proxy
#                    (tests/test_fp8_suite.py runs this part on CPU with a tiny model)
#
# Each part writes $OUT/results.json (one object: env, per-step rc and seconds, summaries,
# benchmark JSON) and $OUT/log.txt. Carry .whl/ (torchdata, torchtitan and its needs) and
# .gpu/ (the BPE tokenizer of benchmarks/bpe_tokenizer.py), both git-ignored.
# Knobs: PY (python3), BUDGET_S (540), PROXY_LAYERS (4), PROXY_STEPS (30), TITAN_MODES
# (eager,compiled,accum8).
set -u
(($#)) || { echo "usage: gpu_suite.sh PART... (tests step attention flex_training proxy gemm titan balance lora flash_attn fp8)" >&2; exit 2; }
OUT=${OUT:-/tmp/gpu_suite_out}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
PREC=${PREC:-bf16}
STEPS=${STEPS:-}
BUDGET_S=${BUDGET_S:-540}
PROXY_LAYERS=${PROXY_LAYERS:-4}
PROXY_STEPS=${PROXY_STEPS:-30}
PROXY_MODES=${PROXY_MODES:-none,selective,full,compile}
TITAN_MODES=${TITAN_MODES:-eager,compiled,accum8}
FP8_RECIPES=${FP8_RECIPES:-none,rowwise,tensorwise}
FP8_MODES=${FP8_MODES:-eager,compile}
mkdir -p "$OUT"
LOG=$OUT/log.txt
RESULTS=$OUT/results.json
RUNS=/tmp/gpu_suite_runs
rm -rf "$RUNS" && mkdir -p "$RUNS"
echo "{\"parts\": \"$*\"}" >"$RESULTS"
DATA=()
source benchmarks/gpu_lib.sh

step env 60 "$PY" -c '
import json, torch
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
    "device": torch.cuda.get_device_name(), "memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30}))' \
    && merge env stdout "$RUNS/env.out"

# The Qwen3-30B-A3B proxy: full width, PROXY_LAYERS blocks, seq 4096, micro-batch 1, trained
# on BPE ids (a 32k vocabulary learnt from the stdlib; the byte tokenizer's 257 ids are not
# a corpus) at a pretraining learning rate, from an init whose routing is not collapsed
# (embedding std 1: see models' embedding_init_std).
PROXY=(--model.num_hidden_layers="$PROXY_LAYERS" --data.seq_len=4096 --train.micro_batch_size=1
    --train.global_batch_size=1 --train.warmup_steps=5 --train.lr=3e-4
    --data.tokenizer=.gpu/tokenizer.json --data.source=stdlib --data.max_tokens=2000000
    --model.embedding_init_std=1.0)

tests() { # two processes: a kernel that faults the device cannot take the others with it
    step pytest_gpu 240 "$PY" -m pytest -v -s -m gpu tests/test_gpu.py -p no:cacheprovider \
        -k "not efficient" --junitxml="$OUT/pytest_gpu.xml"
    step pytest_gpu_efficient 120 "$PY" -m pytest -v -s -m gpu tests/test_gpu.py \
        -p no:cacheprovider -k efficient --junitxml="$OUT/pytest_gpu_efficient.xml"
}
step_checks() { # "step" is taken by gpu_lib.sh's runner
    step pytest_gpu_step 150 "$PY" -m pytest -v -s -m gpu tests/test_gpu_step.py \
        -p no:cacheprovider --junitxml="$OUT/pytest_gpu_step.xml"
}
attention() {
    step attention_kernels 200 "$PY" benchmarks/attention_kernels.py --json "$RUNS/attn.json"
    merge bench.attention_kernels file "$RUNS/attn.json"
}
flex_training() { # FlexAttention in training: GPT-OSS (windows, sinks) with document masks
    for mode in none selective; do
        train "gpt_oss_documents_$mode" 90 configs/debug_gpt_oss.toml --train.steps=20 \
            --data.document_mask=true --train.activation_checkpoint=$mode
    done
    train gpt_oss_documents_compile 150 configs/debug_gpt_oss.toml --train.steps=20 \
        --data.document_mask=true --train.compile=true
}
proxy() { # PROXY_MODES: activation checkpointing modes, "compile", "aux" (aux weight 0.01)
    for mode in ${PROXY_MODES//,/ }; do
        if [[ $mode == aux ]]; then # the same with 10x the published aux-loss weight
            train proxy_aux001 120 configs/qwen3_30b_a3b.toml --train.steps="$PROXY_STEPS" \
                "${PROXY[@]}" --model.router_aux_loss_coef=0.01
            continue
        fi
        if [[ $mode == compile ]]; then
            train proxy_compile 180 configs/qwen3_30b_a3b.toml --train.steps="$PROXY_STEPS" \
                "${PROXY[@]}" --train.compile=true
            continue
        fi
        step "plan_$mode" 60 "$PY" -m moetrain.planner --world-size=1 \
            --config configs/qwen3_30b_a3b.toml --train.device=cuda --train.mixed_precision=bf16 \
            "${PROXY[@]}" --train.activation_checkpoint=$mode --gpu-memory=80 --hardware=h100 \
            --json "$RUNS/plan_$mode.json"
        merge "plan.$mode" file "$RUNS/plan_$mode.json"
        train "proxy_$mode" 120 configs/qwen3_30b_a3b.toml --train.steps="$PROXY_STEPS" \
            "${PROXY[@]}" --train.activation_checkpoint=$mode
    done
}
gemm() { # GEMM rates at the proxy's shapes (the planner's --gemm-rates), MoE host syncs
    step gemm_rates 90 "$PY" benchmarks/gemm_rates.py --config configs/qwen3_30b_a3b.toml \
        --model.num_hidden_layers="$PROXY_LAYERS" --data.seq_len=4096 --train.micro_batch_size=1 \
        --json "$RUNS/gemm_rates.json"
    merge bench.gemm_rates file "$RUNS/gemm_rates.json"
    cp "$RUNS/gemm_rates.json" "$OUT/gemm_rates_qwen3_proxy.json"
    step moe_syncs 90 "$PY" benchmarks/moe_syncs.py --json "$RUNS/moe_syncs.json"
    merge bench.moe_syncs file "$RUNS/moe_syncs.json"
}
balance() { # BALANCE_AUX: aux weights ("published": the config's 0.001, the default); the
    # per-layer balance is logged at steps 1, 10, 20, ...
    local steps=${BALANCE_STEPS:-60}
    for aux in ${BALANCE_AUX:-published}; do
        for variant in ${BALANCE_VARIANTS:-pooled per_layer per_layer_z}; do
            local extra=(--moe.aux_loss_layers="${variant%_z}") name=balance_$variant
            [[ $variant == *_z ]] && extra+=(--moe.z_loss_coef=0.001)
            if [[ $aux != published ]]; then # no dot in the name: merge keys split at dots
                extra+=(--model.router_aux_loss_coef="$aux") && name+=_aux${aux//./p}
            fi
            train "$name" 120 configs/qwen3_30b_a3b.toml --train.steps="$steps" \
                "${PROXY[@]}" "${extra[@]}"
        done
    done
}
lora() { # LoRA (rank 8, attention and routed experts) against full fine-tuning of the proxy
    step plan_lora 60 "$PY" -m moetrain.planner --world-size=1 \
        --config configs/qwen3_30b_a3b.toml --train.device=cuda --train.mixed_precision=bf16 \
        "${PROXY[@]}" --peft.method=lora --gpu-memory=80 --hardware=h100 \
        --json "$RUNS/plan_lora.json"
    merge plan.lora file "$RUNS/plan_lora.json"
    train proxy_lora 120 configs/qwen3_30b_a3b.toml --train.steps="$PROXY_STEPS" "${PROXY[@]}" \
        --peft.method=lora
    train proxy_full 120 configs/qwen3_30b_a3b.toml --train.steps="$PROXY_STEPS" "${PROXY[@]}"
}
fp8() { # bf16 ("none") and each FP8 recipe, eager and compiled, the same steps and data
    local config=${FP8_CONFIG:-configs/qwen3_30b_a3b.toml} extra=("${PROXY[@]}")
    [[ -n ${FP8_ARGS:-} ]] && read -r -a extra <<<"$FP8_ARGS"
    local names=()
    for mode in ${FP8_MODES//,/ }; do
        local args=() limit=120
        case $mode in
        eager) ;;
        compile) args=(--train.compile=true) limit=180 ;;
        *) echo "unknown FP8_MODES entry $mode: eager | compile" >&2 && continue ;;
        esac
        for recipe in ${FP8_RECIPES//,/ }; do
            train "fp8_${recipe}_$mode" "$limit" "$config" --train.steps="$PROXY_STEPS" \
                "${extra[@]}" --train.fp8="$recipe" "${args[@]}"
            names+=("fp8_${recipe}_$mode")
        done
    done
    step fp8_compare 30 "$PY" benchmarks/fp8_speed.py --results "$RESULTS" \
        --json "$RUNS/fp8_speed.json" "${names[@]}"
    merge bench.fp8_speed file "$RUNS/fp8_speed.json"
}
titan() { # eager, compiled, then 8 micro-batches a step: each side's real step, 8 min at most
    # (about 0.2 s a step: most of each limit is two processes building, and compiling)
    local common=(benchmarks/vs_torchtitan.py --layers "$PROXY_LAYERS" --seq 4096)
    for mode in ${TITAN_MODES//,/ }; do
        local args limit=120
        case $mode in
        eager) args=(--warmup 3 --steps 10) ;;
        compiled) args=(--warmup 3 --steps 10 --compile) limit=240 ;;
        accum8) args=(--warmup 1 --steps 3 --profile-steps 1 --accum 8) ;;
        *) echo "unknown TITAN_MODES entry $mode: eager | compiled | accum8" >&2 && continue ;;
        esac
        step "vs_torchtitan_$mode" "$limit" "$PY" "${common[@]}" "${args[@]}" \
            --json "$RUNS/titan_$mode.json"
        merge "bench.vs_torchtitan.$mode" file "$RUNS/titan_$mode.json"
    done
}
flash_attn() { # flash-attn-4 from the venv of .whl/gpu_install.sh (PY), not gpu_lib.sh's /tmp/site
    local PYTHONPATH=$PWD # (exported, as the global one)
    step fa_import 90 "$PY" -c 'import importlib.metadata as m, flash_attn.cute, torch
print({d: m.version(d) for d in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-core")},
    torch.cuda.get_device_capability())' || return 1
    step pytest_gpu_flash_attn 300 "$PY" -m pytest -v -s -m gpu tests/test_gpu.py \
        -p no:cacheprovider -k "flash_attn or flash_attention" \
        --junitxml="$OUT/pytest_gpu_flash_attn.xml"
    step attention_flash_attn 200 "$PY" benchmarks/attention_kernels.py --chunks 8192,16384,32768 \
        --kernels flash_attn,sdpa_flash,sdpa_cudnn,flex --json "$RUNS/attn_flash_attn.json"
    merge bench.attention_flash_attn file "$RUNS/attn_flash_attn.json"
    train gpt_oss_documents_flash_attn 100 configs/debug_gpt_oss.toml --train.steps=20 \
        --data.document_mask=true --parallel.cp_kernel=flash_attn
}

for part in "$@"; do
    case $part in
    tests | attention | flex_training | proxy | gemm | titan | balance | lora | flash_attn | fp8) "$part" ;;
    step) step_checks ;;
    *)
        echo "unknown part $part: tests | step | attention | flex_training | proxy | gemm | titan | balance | lora | flash_attn | fp8" >&2
        exit 2
        ;;
    esac
done
echo "=== done in $SECONDS s" | tee -a "$LOG"
