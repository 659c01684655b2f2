# dfm on an NGC PyTorch image: CUDA, NCCL and Transformer Engine come with the base image.
# Build:  docker build -t dfm .
# Run:    see docker/README.md for mounting data and checkpoint directories.
FROM nvcr.io/nvidia/pytorch:25.09-py3

WORKDIR /opt/dfm
COPY pyproject.toml README.md ./
COPY dfm ./dfm
COPY examples ./examples
COPY scripts ./scripts

# The base image already provides torch and transformer-engine; pip keeps them.
RUN pip install --no-cache-dir -e ".[te,wandb]"

ENV PYTHONUNBUFFERED=1
WORKDIR /opt/dfm/examples/megatron/recipes/dit
CMD ["torchrun", "--nproc-per-node", "1", "pretrain_dit_model.py", "--config-file", "conf/dit_tiny.yaml", "--mock"]
