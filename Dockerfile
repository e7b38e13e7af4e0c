# SageMaker training image for grpo-lightning.
#   docker build -t grpo-lightning:sagemaker .
# The base is an AWS Deep Learning Container for PyTorch training (CUDA, NCCL, EFA, the sagemaker-training
# toolkit). Pick the tag for your region and CUDA from
# https://github.com/aws/deep-learning-containers/blob/master/available_images.md
ARG BASE_IMAGE=763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.6.0-gpu-py312-cu126-ubuntu22.04-sagemaker
FROM ${BASE_IMAGE}

WORKDIR /opt/ml/code
COPY pyproject.toml README.md ./
COPY grpo_lightning ./grpo_lightning
COPY configs ./configs

# Install the project and its dependencies but keep the image's own torch build (CUDA, NCCL and EFA are
# matched to it): the constraint pins torch to exactly the installed version, so pip never replaces it.
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch-constraint.txt \
    && pip install --no-cache-dir -c /tmp/torch-constraint.txt . \
    && python -c "import torch, grpo_lightning.sagemaker; print('torch', torch.__version__, 'ok')"

# The toolkit runs `python $SAGEMAKER_PROGRAM --<hyperparameter> <value> ...` from /opt/ml/code with the
# SM_* variables set; the launcher lives outside the package so that its modules never shadow others.
RUN printf 'from grpo_lightning.sagemaker import main\n\nmain()\n' > /opt/ml/code/train.py
ENV SAGEMAKER_PROGRAM=train.py \
    TOKENIZERS_PARALLELISM=false
