"""The fault hook: corrupt a loaded engine's weights in memory, so its goldens catch it.

For tests and `weir up` demos of invariant 10 (docs/design.md): an instance whose weights changed
after verification must be caught by its golden check, marked unhealthy and reloaded from verified
weights. Only reachable when WorkerSettings.fault_hooks is set (WEIR_FAULT_HOOKS); the hosts refuse
it otherwise (services/worker/hosts/runner.py). Nothing undoes it: the cure is a new engine built from
the verified files.
"""

from __future__ import annotations

import torch

from services.worker.engine import EchoEngine, EmbeddingEngine, Engine, EngineLike

FAULT_SEED = 1234


class FaultHookError(RuntimeError):
    """The fault hook cannot run: hooks are off, or the engine has nothing to corrupt."""


def corrupt(engine: EngineLike) -> str:
    """Perturb `engine`'s model in place; returns what was done, in words.

    torch: every floating weight gets Gaussian noise of its own standard deviation (a seeded
    generator), which garbles greedy output. onnx: the session's weights live in onnxruntime, out
    of reach, so the engine's output is perturbed instead: a fixed random vector, as large as the
    vectors themselves, is added to every fragment's vector before pooling (EmbeddingEngine.
    output_noise). echo has no weights: FaultHookError.
    """
    if isinstance(engine, Engine):
        generator = torch.Generator(device="cpu").manual_seed(FAULT_SEED)
        with torch.no_grad():
            for param in engine.model.parameters():
                if param.is_floating_point() and param.numel() > 1:
                    noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                    param.add_(noise.to(device=param.device, dtype=param.dtype) * param.float().std())
            if engine.model.packed_bytes:  # the CPU matmuls read oneDNN copies of the weights: remake them
                engine.model.pack_weights()
        return "added noise of each weight's own standard deviation to every torch weight"
    if isinstance(engine, EmbeddingEngine):
        generator = torch.Generator(device="cpu").manual_seed(FAULT_SEED)
        engine.output_noise = torch.randn(engine.dimensions, generator=generator, dtype=torch.float64).numpy()
        return "added a fixed random vector to every embedding the onnx session returns"
    if isinstance(engine, EchoEngine):
        raise FaultHookError("the echo engine has no weights to corrupt")
    raise FaultHookError(f"no fault hook for engine {type(engine).__name__}")
