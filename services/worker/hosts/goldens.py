"""Golden canaries: outputs recorded at push, checked again on every loaded instance.

A version's goldens (schemas/registry.py: GoldenCase) are its warmup prompts run greedily
(temperature 0) for a few tokens, with the token ids they produced, and one seeded sampled case
(the first prompt at temperature 1 with GOLDEN_SAMPLED_SEED): the determinism probe, "the same
seeded request on two instances gives identical text" (docs/design.md, "Structured output, tools
and logprobs"); an embedding model's are the vectors with a least cosine similarity. An instance
whose weights changed in memory (a bit flip, a bad device, the fault hook), or whose sampling no
longer follows its seed, produces other tokens and fails its check, so the worker marks it
unhealthy and reloads it from verified weights (docs/design.md, invariant 10). Records written
before the sampled case existed hold greedy cases only, and are checked as they are.

    record_goldens(config)           build the engine here, run the prompts, return GoldenCases
    GoldenChecks.record              the same inside a running engine loop (a worker recording the
                                     goldens of a version registered without any, on its own device)
    golden_problem(case, ids, vec)   pure: why an output departs from its case, or None
    GoldenCheck                      a check in flight inside an engine loop (runner.drive):
                                     golden requests step beside the clients' and never leave it
    run_goldens(engine, cases)       the same, synchronously, stepping the engine until done
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from schemas.messages import EmbedRequest, GenerateRequest, now_ms
from schemas.model_repo import ModelConfig
from schemas.registry import GoldenCase
from services.worker.config import WorkerSettings
from services.worker.engine import EmbeddingEngine, EngineLike, EngineOutput
from services.worker.engine.contract import GOLDEN_ID_PREFIX
from services.worker.hosts.engine_factory import build_engine
from services.worker.hosts.hardware import choose_device

GOLDEN_SEED = 0  # greedy decoding ignores it; fixed so that nothing in a golden depends on its id
GOLDEN_SAMPLED_SEED = 4242  # the sampled case's seed: any fixed value; recorded in the case
GOLDEN_SAMPLED_TEMPERATURE = 1.0  # the model's own distribution: no sharpening hides a sampling difference
GOLDEN_TENANT = "\x1fweir-golden"  # no deployment's watermark tenant: goldens are never watermarked
GOLDEN_TIMEOUT_MS = 120_000
# Run-to-run cosine of the same input through all-MiniLM-L6-v2 on onnxruntime's CPU provider is
# 1.0 to within 1e-7 (tests/test_goldens.py measures it); a corrupted session falls far below.
# 0.999 leaves room for a CPU-recorded vector checked on the CUDA provider (float32 both).
DEFAULT_MIN_COSINE = 0.999
GOLDEN_MAX_TOKENS = 8  # tokens of each recorded golden (`weir models push --golden-max-tokens`' default)

_ids = itertools.count()


def golden_requests(cases: list[GoldenCase], model: str, tag: str) -> list[GenerateRequest | EmbedRequest]:
    """One request per case, at its temperature and seed, with ids under GOLDEN_ID_PREFIX (refused
    from clients, services/worker/kafka/refusals.py) so they cannot clash with a client's."""
    deadline_ms = now_ms() + GOLDEN_TIMEOUT_MS
    common = {"model": model, "deadline_ms": deadline_ms, "reply_to": "-", "tenant": GOLDEN_TENANT}
    requests: list[GenerateRequest | EmbedRequest] = []
    for i, case in enumerate(cases):
        request_id = f"{GOLDEN_ID_PREFIX}{tag}-{i}"
        if case.kind == "embed":
            requests.append(EmbedRequest(request_id=request_id, inputs=[case.prompt], **common))
        else:
            requests.append(
                GenerateRequest(
                    request_id=request_id,
                    prompt=case.prompt,
                    max_tokens=case.max_tokens,
                    temperature=case.temperature,
                    seed=case.seed,
                    **common,
                )
            )
    return requests


def golden_problem(case: GoldenCase, token_ids: list[int] | None, vector: list[float] | None) -> str | None:
    """Why an output departs from `case` (naming it, expected vs got), or None when it matches."""
    name = f"golden {case.prompt[:40]!r}"
    if case.temperature > 0:
        name += f" (temperature {case.temperature:g}, seed {case.seed})"
    if case.kind == "embed":
        if vector is None:
            return f"{name}: no vector came back"
        if len(vector) != len(case.expected_vector):
            return f"{name}: expected a {len(case.expected_vector)}-d vector, got {len(vector)}-d"
        cosine = _cosine(case.expected_vector, vector)
        if not cosine >= case.min_cosine:  # NaN fails too
            return f"{name}: cosine {cosine:.6f} to the recorded vector, below {case.min_cosine}"
        return None
    if token_ids is None:
        return f"{name}: no tokens came back"
    if token_ids == case.expected_token_ids:
        return None
    at = next(
        (i for i, (a, b) in enumerate(zip(case.expected_token_ids, token_ids, strict=False)) if a != b),
        min(len(token_ids), len(case.expected_token_ids)),
    )
    expected = case.expected_token_ids[at] if at < len(case.expected_token_ids) else "(end)"
    got = token_ids[at] if at < len(token_ids) else "(end)"
    return f"{name}: token {at} expected {expected}, got {got} (expected {case.expected_token_ids}, got {token_ids})"


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm > 0 else float("nan")


class GoldenCheck:
    """One check in flight in an engine: collects its requests' outputs, then knows its problem."""

    def __init__(self, engine: EngineLike, cases: list[GoldenCase], model: str = "golden") -> None:
        self.cases = cases
        requests = golden_requests(cases, model, str(next(_ids)))
        self._index = {r.request_id: i for i, r in enumerate(requests)}
        self.token_ids: dict[int, list[int]] = {i: [] for i in range(len(cases))}  # what each case produced
        self.vectors: dict[int, list[float]] = {}
        self.failures: dict[int, str] = {}  # cases that did not complete (refused, timed out, error)
        self._results: dict[int, str | None] = {}
        for i, request in enumerate(requests):
            out = engine.add(request, now_ms())
            if out is not None:  # refused at once (a prompt too long for this engine...)
                self._end(i, out)

    @property
    def is_done(self) -> bool:
        return len(self._results) == len(self.cases)

    def problem(self) -> str | None:
        """The first case's problem, in case order (None when every case passed)."""
        return next((self._results[i] for i in range(len(self.cases)) if self._results[i]), None)

    def take(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """Keep this check's outputs, return the others (the clients')."""
        rest = []
        for out in outputs:
            i = self._index.get(out.request_id)
            if i is None:
                rest.append(out)
                continue
            self.token_ids[i].extend(out.token_ids)
            if out.is_final:
                self._end(i, out)
        return rest

    def _end(self, i: int, out: EngineOutput) -> None:
        case = self.cases[i]
        if out.error is not None or out.finish_reason not in ("stop", "length"):
            detail = out.error.message if out.error is not None else out.finish_reason
            self.failures[i] = f"golden {case.prompt[:40]!r}: ended {out.finish_reason} ({detail})"
            self._results[i] = self.failures[i]
            return
        if out.embeddings:
            self.vectors[i] = out.embeddings[0]
        self._results[i] = golden_problem(case, self.token_ids[i], self.vectors.get(i))


class GoldenChecks:
    """The checks in flight in one engine loop, each answered once its requests have finished."""

    def __init__(self, engine: EngineLike, answer: Callable[[int, bool, object], None]) -> None:
        self._engine = engine
        self._answer = answer
        self._checks: dict[int, GoldenCheck] = {}
        self._recording: set[int] = set()  # checks that record (answered with their cases), not compare

    def start(self, token: int, cases: list[GoldenCase]) -> None:
        try:
            self._checks[token] = GoldenCheck(self._engine, cases)
        except Exception as exc:  # noqa: BLE001 - a bad case is the asker's answer, not the engine's end
            self._answer(token, False, f"{type(exc).__name__}: {exc}")

    def record(self, token: int, what: tuple[list[str], int]) -> None:
        """Record goldens of `what` (prompts, max_tokens) in this engine, as record_goldens does:
        answered with the cases."""
        prompts, max_tokens = what
        try:
            self._checks[token] = GoldenCheck(self._engine, golden_cases(self._engine, prompts, max_tokens))
            self._recording.add(token)
        except Exception as exc:  # noqa: BLE001 - as in start()
            self._answer(token, False, f"{type(exc).__name__}: {exc}")

    @property
    def is_running(self) -> bool:
        """Some check is in flight in the engine."""
        return bool(self._checks)

    def take(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """The clients' outputs; golden ones are kept, and finished checks answered."""
        for token, check in list(self._checks.items()):
            outputs = check.take(outputs)
            if check.is_done:
                del self._checks[token]
                if token in self._recording:
                    self._recording.discard(token)
                    self._answer_recorded(token, check)
                else:
                    self._answer(token, True, check.problem())
        return outputs

    def _answer_recorded(self, token: int, check: GoldenCheck) -> None:
        try:
            self._answer(token, True, recorded_cases(check))
        except ValueError as exc:
            self._answer(token, False, str(exc))


def run_goldens(
    engine: EngineLike, cases: list[GoldenCase], on_other: Callable[[list[EngineOutput]], None] | None = None
) -> str | None:
    """Run `cases` in `engine` now, stepping it until they finish; the first problem, or None.

    Other requests in the engine keep stepping; their outputs go to `on_other`. Without it the
    engine must hold no other work (their outputs would be lost): ValueError.
    """
    if on_other is None and engine.has_work:
        raise ValueError("the engine has other requests running: pass on_other to receive their outputs")
    check = GoldenCheck(engine, cases)
    _step_until_done(engine, check, on_other)
    return check.problem()


def _step_until_done(
    engine: EngineLike, check: GoldenCheck, on_other: Callable[[list[EngineOutput]], None] | None
) -> None:
    while not check.is_done:
        if not engine.has_work:
            raise RuntimeError("the engine went idle before the golden requests finished")
        rest = check.take(engine.step(now_ms()))
        if rest and on_other is not None:
            on_other(rest)


def record_goldens(
    config: ModelConfig,
    prompts: list[str] | None = None,
    max_tokens: int = GOLDEN_MAX_TOKENS,
    settings: WorkerSettings | None = None,
) -> list[GoldenCase]:
    """Build `config`'s engine in this process (on the CPU unless `settings` say otherwise), run
    each prompt greedily and return the cases: up to `max_tokens` token ids each (fewer when the
    model ends its answer), or for an embedding model (which makes no tokens) its vector.
    ValueError when a prompt does not complete."""
    settings = settings or WorkerSettings(device="cpu")
    prompts = list(config.warmup) if prompts is None else prompts
    if not prompts:
        raise ValueError(f"model {config.name!r}: no prompts to record goldens with (and no warmup prompts)")
    engine = build_engine(config, settings, choose_device(settings.device))
    check = GoldenCheck(engine, golden_cases(engine, prompts, max_tokens))
    _step_until_done(engine, check, None)
    try:
        return recorded_cases(check)
    except ValueError as exc:
        raise ValueError(f"model {config.name!r}: {exc}") from exc


def golden_cases(engine: EngineLike, prompts: list[str], max_tokens: int) -> list[GoldenCase]:
    """The cases to record for `prompts`: an embedding model's vector, else up to `max_tokens`
    greedy tokens each, then the first prompt sampled with a fixed seed (the determinism probe)."""
    if isinstance(engine, EmbeddingEngine):  # a vector per prompt
        return [GoldenCase(kind="embed", prompt=p, min_cosine=DEFAULT_MIN_COSINE) for p in prompts]
    cases = [GoldenCase(prompt=p, max_tokens=max_tokens, seed=GOLDEN_SEED) for p in prompts]
    if prompts:
        cases.append(
            GoldenCase(
                prompt=prompts[0],
                max_tokens=max_tokens,
                temperature=GOLDEN_SAMPLED_TEMPERATURE,
                seed=GOLDEN_SAMPLED_SEED,
            )
        )
    return cases


def recorded_cases(check: GoldenCheck) -> list[GoldenCase]:
    """A finished recording check's cases with what each produced; ValueError when one did not complete."""
    if check.failures:
        raise ValueError(f"a golden prompt did not complete: {next(iter(check.failures.values()))}")
    return [_recorded(case, check.token_ids[i], check.vectors.get(i)) for i, case in enumerate(check.cases)]


def _recorded(case: GoldenCase, token_ids: list[int], vector: list[float] | None) -> GoldenCase:
    if case.kind == "embed":
        return case.model_copy(update={"expected_vector": vector or []})
    return case.model_copy(update={"expected_token_ids": token_ids})
