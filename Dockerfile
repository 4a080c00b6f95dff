# gguf-prefill HTTP server (OpenAI-compatible) on an NVIDIA GPU.
#
#   docker build -t gguf-prefill .
#   docker run --gpus all -v ~/.cache/gguf-prefill:/models -p 8080:8080 gguf-prefill
#   docker run --gpus all -v /path/to/dir:/models -p 8080:8080 gguf-prefill -m /models/model.gguf
#
# The CUDA *runtime* image is enough: CuPy's [ctk] extra brings NVRTC and the CUDA headers
# from pip, and the kernels are compiled at run time. Ubuntu 24.04 ships Python 3.12
# (the project needs >= 3.11).
FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# One virtual environment, on PATH, so `gguf-prefill` is the installed console script.
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
COPY kernels_cu ./kernels_cu
RUN pip install ".[cuda12]" && rm -rf /src

# Non-root; the model directory is a mount point. Without -m the server looks for the default
# model under $GGUF_PREFILL_HOME (= /models); host and port also come from the environment, so
# `docker run ... gguf-prefill -m /models/x.gguf` still listens on 0.0.0.0:8080.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin app \
    && mkdir -p /models && chown app:app /models
ENV GGUF_PREFILL_HOME=/models \
    GGUF_PREFILL_HOST=0.0.0.0 \
    GGUF_PREFILL_PORT=8080
VOLUME ["/models"]
WORKDIR /home/app
USER app

EXPOSE 8080

# /health: 200 once the server can answer (never needs the API key). The port only opens after
# the model has loaded (the log shows progress, then a startup line and "ready"), so a check
# during the load fails as "connection refused"; --start-period covers the load.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=4)"]

# SIGTERM (docker stop) drains in-flight requests for up to --shutdown-timeout seconds
# (default 30); then streams get an SSE error event and other requests a JSON 503. Give
# `docker stop -t` a few seconds more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["gguf-prefill", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8080"]
