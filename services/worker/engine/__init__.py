"""The worker's engine core: synchronous engines that take requests, step, and emit outputs.

No Kafka here and no clock of its own: every call takes `now_ms`, so tests and benchmarks drive
an engine directly. The worker's edge (services/worker/hosts/runner.py) runs one beside its event loop.

    contract.py          EngineLike: add, cancel, step, has_work, stats, weights_sha256
    sequence.py          Sequence (one request's state) and EngineOutput (what every engine emits)
    llm_engine.py        Engine: continuous batching of a causal LM over a paged KV cache
      scheduler.py       which sequences run each step, within a token budget
      kv_cache.py        the block manager (prefix caching) and the per-layer KV tensors
      model.py           the Llama/Qwen2 model, loaded from a Hugging Face directory
      rope.py            RoPE variants of config.json (default, linear, dynamic, llama3)
      sampler.py         batched sampling from each request's own generator
      tokenizer.py       encoding, incremental detokenizing, special and stop tokens (the chat template
                         renderer is weir/chat_template.py, shared with the gateway's /tokenize)
      watermark.py       the per-tenant green-list bias and its detector
    echo_engine.py       EchoEngine: streams the prompt back (engine = "echo")
    embedding_engine.py  EmbeddingEngine: ONNX sentence embeddings (engine = "onnx")
"""

from services.worker.engine.contract import EngineLike
from services.worker.engine.echo_engine import EchoEngine
from services.worker.engine.embedding_engine import EmbeddingEngine
from services.worker.engine.llm_engine import Engine, EngineConfig
from services.worker.engine.sequence import EngineOutput, Sequence, Status
from services.worker.engine.watermark import Watermarker

__all__ = [
    "EchoEngine",
    "EmbeddingEngine",
    "Engine",
    "EngineConfig",
    "EngineLike",
    "EngineOutput",
    "Sequence",
    "Status",
    "Watermarker",
]
