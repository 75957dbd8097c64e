"""Label-smoothed cross-entropy (Szegedy et al., 2016) fused with the output projection and its bias.

Why fused: on a small model the (tokens x vocabulary) logits dominate training. Autograd would
write them to memory and read them back five or six times (log_softmax, gather, mean and their
backward buffers), which is memory-bound on a CPU. Here rows are processed in chunks, each chunk's
logits are turned into the loss and straight into the gradient in two reused buffers, and only the
(N, D), (V, D) and (V,) gradients are kept. The logits are the ones decoding scores with,
x_i = W h_i + b, b the output bias where the model has one (an imported Marian model's, whose pad
entry is NOT_A_TOKEN), so that the loss is the NLL of the model as it translates. The smoothing
mass eps is spread uniformly over all V classes:
    loss_i = logsumexp(x_i) - (1 - eps) * x_i[y_i] - eps * mean(x_i)
    d loss_i / d x_i = softmax(x_i) - (1 - eps) * onehot(y_i) - eps / V
Three identities keep the passes over the logits to a softmax and a cast:
    logsumexp(x_i) - x_i[y_i] = -log softmax(x_i)[y_i]     (the NLL, from the softmax itself)
    mean(x_i) = h_i . mean(W) + mean(b)                     (a matrix-vector product, no pass)
    (eps / V) 1^T W = (eps / V) sum(W)                      (the uniform term as a rank-one correction)
The bias's gradient is the column sum of d loss / d x. Softmax, sums and gradients are kept in
fp32, or in fp64 for fp64 inputs (what torch.autograd.gradcheck needs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mtkit.data.tokenizer import PAD_ID
from mtkit.model.transformer import Transformer
from mtkit.runtime import autocast

CHUNK_ROWS = 1024
# Below this probability -log p loses precision to fp32 underflow; such rows take the exact logsumexp.
TINY_PROBABILITY = 1e-30


def _chunk_losses(
    h: Tensor,
    w: Tensor,
    bias: Tensor | None,
    target: Tensor,
    logits: Tensor,
    probs: Tensor,
    w_sum: Tensor,
    b_mean: Tensor | float,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """Per-row smoothed loss and NLL of the rows ``h``; leaves softmax(h w^T + bias) in ``probs``.

    ``logits`` (``h``'s dtype) and ``probs`` (the sums' dtype: fp32, or fp64) are buffers of ``h``'s shape, the
    same one where the dtypes agree; ``bias`` (V,) is in the sums' dtype, so that it adds at full precision.
    """
    torch.mm(h, w.t(), out=logits)
    if probs.data_ptr() != logits.data_ptr():
        probs.copy_(logits)
    if bias is not None:
        probs += bias
    gold = probs.gather(1, target)
    if reads_wait_for(probs.device):
        nll = _nll_then_softmax_without_reads(probs, gold)
    else:
        nll = _nll_then_softmax(h, w, bias, probs, gold, target)
    mean_logit = (h.to(probs.dtype) @ w_sum)[:, None] / w.size(0) + b_mean
    return (1.0 - eps) * nll + eps * (gold + nll - mean_logit), nll


def reads_wait_for(device: torch.device) -> bool:
    """Whether the host, reading a value back from ``device``, first waits for all the work queued on it (a GPU)."""
    return device.type != "cpu"


def _nll_then_softmax(h: Tensor, w: Tensor, bias: Tensor | None, probs: Tensor, gold: Tensor, target: Tensor) -> Tensor:
    """-log softmax(logits)[gold] per row, leaving the softmax in ``probs`` (which holds the logits): one softmax
    pass, and the exact logsumexp only for the rare rows whose gold probability underflows."""
    torch.softmax(probs, dim=-1, out=probs)
    gold_probability = probs.gather(1, target)
    nll = -gold_probability.log()
    tiny = gold_probability < TINY_PROBABILITY
    if tiny.any():  # the softmax overwrote the logits: recompute those rows
        rows = tiny.squeeze(1).nonzero().squeeze(1)
        exact = (h[rows] @ w.t()).to(probs.dtype)
        if bias is not None:
            exact += bias
        nll[rows] = torch.logsumexp(exact, dim=-1, keepdim=True) - gold[rows]
    return nll


def _nll_then_softmax_without_reads(probs: Tensor, gold: Tensor) -> Tensor:
    """``_nll_then_softmax`` where asking whether any row underflowed would stall the device until it knows
    (a GPU): the logsumexp of every row first, then the softmax from it, a pass more over the logits."""
    logsumexp = torch.logsumexp(probs, dim=-1, keepdim=True)
    probs.sub_(logsumexp).exp_()
    return logsumexp - gold


class _LinearSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, features: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, eps: float, dtype: torch.dtype
    ):
        h = features.to(dtype)
        w = weight.to(dtype)
        sums = torch.promote_types(dtype, torch.float32)  # softmax, sums and gradients: fp32, or fp64
        b = None if bias is None else bias.to(sums)
        rows, vocab = h.size(0), w.size(0)
        want_grad = any(t is not None and t.requires_grad for t in (features, weight, bias))
        w_sum = w.to(sums).sum(dim=0)  # (D,)
        b_mean = 0.0 if b is None else b.mean()
        logits = h.new_empty(min(rows, CHUNK_ROWS), vocab)
        probs = logits if dtype == sums else torch.empty_like(logits, dtype=sums)
        grad_h = torch.empty_like(features, dtype=sums) if want_grad else None
        grad_w = torch.zeros_like(weight, dtype=sums) if want_grad else None
        grad_b = torch.zeros_like(b) if want_grad and b is not None else None
        loss_sum = torch.zeros((), dtype=sums, device=features.device)
        nll_sum = torch.zeros((), dtype=sums, device=features.device)
        for start in range(0, rows, CHUNK_ROWS):
            h_c = h[start : start + CHUNK_ROWS]
            y_c = target[start : start + CHUNK_ROWS, None]
            n = h_c.size(0)
            loss, nll = _chunk_losses(h_c, w, b, y_c, logits[:n], probs[:n], w_sum, b_mean, eps)
            loss_sum += loss.sum()
            nll_sum += nll.sum()
            if not want_grad:
                continue
            grad = probs[:n].scatter_add_(1, y_c, torch.full_like(nll, eps - 1.0))
            if grad_b is not None:
                grad_b += grad.sum(dim=0)
            if grad.dtype != dtype:
                grad = logits[:n].copy_(grad)
            grad_h[start : start + n] = grad @ w
            grad_w += (grad.t() @ h_c).to(sums)
        if want_grad and eps:
            grad_h -= (eps / vocab) * w_sum
            grad_w -= (eps / vocab) * h.to(sums).sum(dim=0)
            if grad_b is not None:
                grad_b -= eps * rows / vocab
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (features.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(nll_sum)
        return loss_sum, nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        grad_bias = None if grad_b is None else (grad_b * grad_loss).to(b_dtype)
        return (grad_h * grad_loss).to(h_dtype), (grad_w * grad_loss).to(w_dtype), grad_bias, None, None, None


def linear_cross_entropy(
    features: Tensor,
    weight: Tensor,
    target: Tensor,
    eps: float,
    dtype: torch.dtype = torch.float32,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed loss and summed plain NLL of ``features @ weight.T + bias`` against ``target``.

    features (N, D) are the decoder outputs at real (non-pad) target positions, weight (V, D) the
    output projection, bias (V,) its bias or None, target (N,) the gold ids. ``dtype`` is the matmul
    precision (bf16 under mixed precision); softmax, the bias and sums are fp32 (fp64 for fp64 matmuls).
    Only the first result carries a gradient.
    """
    return _LinearSmoothedCrossEntropy.apply(features, weight, bias, target, eps, dtype)


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

    def compile_features(self, shapes: int | None = None) -> None:
        """Compile the encoder-decoder: for each of at most ``shapes`` batch shapes (ShapeBuckets), or once for
        any shape when None (kernels for symbolic sizes, slower than specialised ones)."""
        if shapes is None:
            self._features = torch.compile(self.model.features, dynamic=True)
            return
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, shapes)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, shapes)
        self._features = torch.compile(self.model.features, dynamic=False)

    def forward(
        self, src: Tensor, src_pad_mask: Tensor, tgt_in: Tensor, tgt_out: Tensor, target_index: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Summed smoothed loss and summed NLL over the real (non-pad) target tokens, of the logits decoding
        scores with (the output projection and its bias); ``target_index``: their flat positions, when known."""
        features_of = self._features if torch.is_grad_enabled() else self.model.features  # validation: eager
        with autocast(src.device, self.dtype):
            features = features_of(src, src_pad_mask, tgt_in)
        if target_index is None:
            target_index = (tgt_out != PAD_ID).flatten().nonzero().squeeze(1)
        output = self.model.output
        return linear_cross_entropy(
            features.flatten(0, 1).index_select(0, target_index),
            output.weight,
            tgt_out.flatten().index_select(0, target_index),
            self.label_smoothing,
            self.dtype,
            output.bias,
        )
