# The image `od-dist k8s --image` names: od-dist installed by the README's set-up command, and the
# demo's data where its pipeline reads it. Build it from the repository's root and push it:
#   docker build -t registry.example/od-dist:0.1 . && docker push registry.example/od-dist:0.1
FROM python:3.11-slim

# The pods run `od-dist train` here: `--pipeline` and the pipeline's relative paths resolve here.
WORKDIR /od-dist
ENV PIP_NO_CACHE_DIR=1 PATH=/od-dist/.venv/bin:$PATH

# What `pip install -e .` reads (setup.cfg takes its long description from README.md).
COPY pyproject.toml setup.cfg README.md ./
COPY od_dist/ od_dist/
RUN python3 -m venv .venv && .venv/bin/pip install -e .
# The GPU variant, for GPU nodes: docker build --build-arg EXTRAS=gpu -t registry.example/od-dist:0.1-gpu .
# It adds TensorFlow's CUDA libraries (setup.cfg's extra `gpu`, README: GPU machines); the NVIDIA
# driver comes from the node (NVIDIA Container Toolkit: docker run --gpus all; `od-dist k8s --gpus`).
ARG EXTRAS=""
RUN if [ -n "$EXTRAS" ]; then .venv/bin/pip install -e ".[$EXTRAS]"; fi

COPY pipelines/ pipelines/
COPY clusters/ clusters/
# The demo's synthetic data at data/shapes/, as pipelines/shapes_retinanet.yaml names it. Your own
# records: COPY them in here, or put them on the model_dir volume and point the pipeline there.
RUN od-dist data shapes
