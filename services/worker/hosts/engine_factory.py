"""The engine a model entry asks for, built and warmed up: what the worker runs in each host.

Called by app.py (an engine on a thread of the worker) and by runner.serve_engine (an engine in
a child process of its own), so both build and warm up an engine the same way. Reads the
worker's settings, so it lives at the edge, beside them; the engines themselves are in engine/.
"""

from __future__ import annotations

import logging

import torch

from schemas.messages import EmbedRequest, GenerateRequest, now_ms
from schemas.model_repo import ModelConfig, detect_engine
from services.worker.config import WorkerSettings
from services.worker.engine import EchoEngine, EmbeddingEngine, Engine, EngineConfig, EngineLike, Watermarker
from services.worker.hosts.hardware import cpu_threads, resolve_engine
from weir.embedding.onnx_export import ensure_export, needs_export
from weir.models.sources import ensure_model_dir

log = logging.getLogger(__name__)


def build_engine(config: ModelConfig, settings: WorkerSettings, device: torch.device) -> EngineLike:
    """The engine a model entry asks for (engine="auto" resolved for `device`: resolve_engine).
    Raises on a model that cannot load (process-fatal)."""
    if config.engine == "auto":
        config = config.model_copy(update={"engine": resolve_engine(config, device)[0]})
    if config.engine == "echo":
        return EchoEngine(config.max_model_len, config.max_num_seqs, settings.echo_step_delay_ms / 1000)
    if config.engine == "onnx":  # an embedding model; exported from its source package on first use
        return EmbeddingEngine(
            ensure_export(config),
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            use_cuda=device.type == "cuda",
            num_threads=cpu_threads(settings.threads),
            dimensions=config.dimensions,
        )
    engine_config = EngineConfig(
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        block_size=settings.block_size,
        kv_cache_bytes=settings.kv_cache_bytes,
        is_prioritized=config.lane_policy != "fifo",
        quantization=config.quantization,
    )
    # A GGUF source is imported on first use (weir up has usually done it already) and reused after.
    model_dir = ensure_model_dir(config, lambda line: log.info("model %s: %s", config.name, line))
    engine = Engine(model_dir, engine_config, device, Watermarker(settings.watermarks()))
    engine.clock = now_ms  # tokens are timed when the pass that made them ends (vllm:* times, traces)
    return engine


def build_step(config: ModelConfig) -> str:
    """What build_engine is about to do for `config`, in words (the worker's /readyz says it)."""
    engine = detect_engine(config.path, config.source) if config.engine == "auto" else config.engine
    if engine == "onnx" and needs_export(config):
        return "exporting it to ONNX (first start only), then loading it"
    return "loading the weights"


def warm_up(engine: EngineLike, config: ModelConfig, prewarm_grammars: bool = False) -> None:
    """Run the model entry's warmup prompts to completion before the worker reports ready; with
    `prewarm_grammars` (WEIR_GRAMMAR_PREWARM), also start the engine's grammar compile child in
    the background, so the first constrained request does not wait for it (seconds)."""
    deadline_ms = now_ms() + 600_000
    requests: list[GenerateRequest | EmbedRequest]
    if isinstance(engine, EmbeddingEngine):  # an embedding model embeds them, in one request
        requests = (
            [
                EmbedRequest(
                    request_id="warmup-0",
                    model=config.name,
                    inputs=config.warmup,
                    deadline_ms=deadline_ms,
                    reply_to="-",
                )
            ]
            if config.warmup
            else []
        )
    else:
        requests = [
            GenerateRequest(
                request_id=f"warmup-{i}",
                model=config.name,
                prompt=prompt,
                max_tokens=4,
                temperature=0.0,
                deadline_ms=deadline_ms,
                reply_to="-",
            )
            for i, prompt in enumerate(config.warmup)
        ]
    for i, request in enumerate(requests):
        out = engine.add(request, now_ms())
        if out is not None:
            raise ValueError(f"model {config.name!r}: warmup prompt {i} refused: {out.error}")
        while engine.has_work:
            engine.step(now_ms())
    if prewarm_grammars and isinstance(engine, Engine):
        engine.prewarm_constraints()
