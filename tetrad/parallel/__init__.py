"""3D tensor-parallel layers (AxoNN's algorithm) and the gradient plumbing they need."""

from tetrad.parallel.embedding import Embedding
from tetrad.parallel.grads import clip_grad_norm, global_grad_norm, sync_gradients
from tetrad.parallel.head import VocabParallelHead
from tetrad.parallel.linear import Linear
from tetrad.parallel.loss import lm_head_loss, vocab_parallel_cross_entropy
from tetrad.parallel.norm import RMSNorm
from tetrad.parallel.placement import Placement, init_parameters

__all__ = [
    "Embedding",
    "Linear",
    "Placement",
    "RMSNorm",
    "VocabParallelHead",
    "clip_grad_norm",
    "global_grad_norm",
    "init_parameters",
    "lm_head_loss",
    "sync_gradients",
    "vocab_parallel_cross_entropy",
]
