"""Label-smoothed cross-entropy (Szegedy et al., 2016) fused with the output projection.

Why fused: on a small model the (tokens x vocabulary) logits dominate training. Autograd would
write them to memory and read them back five or six times (log_softmax, gather, mean and their
backward buffers), which is memory-bound on a CPU. Here rows are processed in chunks small enough
to stay in cache: each chunk's logits are computed, turned into the loss and straight into the
gradient, and only the (N, D) and (V, D) gradients are kept. The smoothing mass eps is spread
uniformly over all V classes:
    loss_i = logsumexp(x_i) - (1 - eps) * x_i[y_i] - eps * mean(x_i)
    d loss_i / d x_i = softmax(x_i) - (1 - eps) * onehot(y_i) - eps / V
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mtkit.model import Transformer
from mtkit.runtime import autocast
from mtkit.tokenizer import PAD_ID

CHUNK_ROWS = 1024


class _LinearSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features: Tensor, weight: Tensor, target: Tensor, eps: float, dtype: torch.dtype):
        h = features.to(dtype)
        w = weight.to(dtype)
        grad_h = torch.empty_like(features, dtype=torch.float32)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        loss_sum = torch.zeros((), dtype=torch.float32, device=features.device)
        nll_sum = torch.zeros((), dtype=torch.float32, device=features.device)
        vocab = weight.size(0)
        for start in range(0, h.size(0), CHUNK_ROWS):
            h_c = h[start : start + CHUNK_ROWS]
            y_c = target[start : start + CHUNK_ROWS, None]
            logits = (h_c @ w.t()).float()  # (n, V)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            nll = lse - logits.gather(1, y_c)
            nll_sum += nll.sum()
            loss_sum += ((1.0 - eps) * nll + eps * (lse - logits.mean(dim=-1, keepdim=True))).sum()
            grad = logits.sub_(lse).exp_()  # softmax, written over the logits
            if eps:
                grad.sub_(eps / vocab)
            grad.scatter_add_(1, y_c, torch.full_like(lse, eps - 1.0))
            grad = grad.to(dtype)
            grad_h[start : start + CHUNK_ROWS] = grad @ w
            grad_w += (grad.t() @ h_c).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (features.dtype, weight.dtype)
        ctx.mark_non_differentiable(nll_sum)
        return loss_sum, nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (grad_h * grad_loss).to(h_dtype), (grad_w * grad_loss).to(w_dtype), None, None, None


def linear_cross_entropy(
    features: Tensor, weight: Tensor, target: Tensor, eps: float, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed loss and summed plain NLL of ``features @ weight.T`` against ``target``.

    features (N, D) are the decoder outputs at real (non-pad) target positions, weight (V, D) the
    output projection, target (N,) the gold ids. ``dtype`` is the matmul precision (bf16 under
    mixed precision); softmax and sums are always fp32. Only the first result carries a gradient.
    """
    return _LinearSmoothedCrossEntropy.apply(features, weight, target, eps, dtype)


class TrainingObjective(nn.Module):
    """A model's summed training loss on a batch, as one module: the unit DistributedDataParallel wraps.

    DDP synchronises the parameters a wrapped ``forward`` uses, and the loss uses the output
    projection outside ``Transformer.forward``; wrapping model and loss together covers both.
    ``compile_features`` swaps in a torch.compile'd encoder-decoder for training only (gradients
    on); validation and beam search keep the eager model and need no second compilation.
    """

    def __init__(self, model: Transformer, label_smoothing: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model
        self.label_smoothing = label_smoothing
        self.dtype = dtype
        self._features: Callable[..., Tensor] = model.features

    def compile_features(self) -> None:
        self._features = torch.compile(self.model.features, dynamic=True)

    def forward(self, src: Tensor, src_pad_mask: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> tuple[Tensor, Tensor]:
        """Summed smoothed loss and summed NLL over the real (non-pad) target tokens."""
        features_of = self._features if torch.is_grad_enabled() else self.model.features  # validation: eager
        with autocast(src.device, self.dtype):
            features = features_of(src, src_pad_mask, tgt_in)
        keep = tgt_out != PAD_ID
        return linear_cross_entropy(
            features[keep], self.model.output.weight, tgt_out[keep], self.label_smoothing, self.dtype
        )
