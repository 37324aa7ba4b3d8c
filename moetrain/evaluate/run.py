"""Build the model on the config's layout, load saved weights into it, and evaluate."""

from __future__ import annotations

import os

import torch.distributed as dist

from moetrain.build.distributed import init_distributed, resolve_device
from moetrain.build.model import build_model
from moetrain.checkpoint.checkpointer import Checkpointer
from moetrain.checkpoint.frozen_base import check_base, load_base, recorded_base
from moetrain.checkpoint.resume import accept_model, old_holdout
from moetrain.config import JobConfig
from moetrain.data.run_data import build_data
from moetrain.data.tokenizers import build_tokenizer
from moetrain.hf.weights import load_hf_weights
from moetrain.loop.evaluation import Evaluator, batch_preparer
from moetrain.loop.pipelined import embedding_names, pipeline_evaluation
from moetrain.loop.preflight import preflight
from moetrain.models import get_model_spec
from moetrain.parallelisms.dims import ParallelDims
from moetrain.parallelisms.mesh import build_meshes
from moetrain.parallelisms.pipeline import SharedEmbedding


def evaluate_weights(cfg: JobConfig, dims: ParallelDims, checkpoint: str | None) -> dict | None:
    """The eval record (rank 0; None on the others) of the weights of `checkpoint`, or of
    `model.init_from_hf` when `checkpoint` is None."""
    corpora = preflight(cfg, dims)
    spec = get_model_spec(cfg.model.name)
    device = resolve_device(cfg.train.device)
    init_distributed(device)
    try:
        meshes = build_meshes(dims, device.type)
        model, parallel = build_model(cfg, spec, dims, meshes, device)
        source = checkpoint
        if checkpoint is not None:
            loader = Checkpointer(os.path.dirname(os.path.abspath(checkpoint)), 0, False)
            state = loader.read(checkpoint, resuming=False)  # a damaged one is refused
            accept_model(checkpoint, state, cfg, spec)
            if cfg.eval.fraction is not None:  # the old hash's held-out documents are not
                old_holdout(checkpoint, state, cfg)  # these: it trained on most of them
            frozen = state.get("frozen_saved", True)
            if not frozen:  # LoRA adapters alone: their base first, the one their run had
                base = recorded_base(checkpoint, state)
                check_base(checkpoint, base, cfg)
                load_base(base, model, spec, cfg.model.args, whole=parallel.whole)
            loader.load_model(checkpoint, model, frozen)
            source = f"{checkpoint} (step {state['step']})"
        else:
            hf_dir = cfg.model.init_from_hf
            load_hf_weights(model, spec.hf_adapter, cfg.model.args, hf_dir, whole=parallel.whole)
            source = hf_dir
        tokenizer = build_tokenizer(cfg.data)
        data = build_data(cfg.data, cfg.eval, tokenizer, cfg.model.args.vocab_size, corpora)
        terms = spec.loss_terms(cfg.model.args)
        prepare = batch_preparer(
            device,
            terms.mtp_depth,
            dims.cp,
            meshes.world.get_local_rank("cp"),
            cfg.parallel.cp_layout,
        )
        evaluator = Evaluator(
            data.held_out,
            cfg.eval.micro_batch_size,
            meshes.dp_rank(),
            dims.dp_size,
            prepare,
            terms,
            cfg.data.document_mask,
        )
        if parallel.embedding_on_last:  # a V's last stage copy on this rank, as loaded
            SharedEmbedding(
                parallel.stages, embedding_names(parallel.whole, spec.plan), None
            ).sync()
        stages = pipeline_evaluation(cfg, parallel, meshes, device, terms, model)  # pp=1: None
        record = {"weights": source, **evaluator(model, stages)}
        dist.barrier()
        return record if dist.get_rank() == 0 else None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
