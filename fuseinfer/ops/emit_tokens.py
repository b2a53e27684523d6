"""The tail of a fast-decode step: choose each row's next token, record it and the stop state, advance the counters.

``emit_tokens(scores, eos, pad, tokens, positions, q_start, decode_idx, step, unfinished, out, alive, scratch)``
takes the first maximum of each row of ``scores`` (B, V) fp32 (the logits for greedy decoding; the sampling rule's
scores otherwise, see ``fuseinfer.runtime.decode.Sampling``) as that row's token, pads rows that have finished,
clears ``unfinished`` for rows that produced an EOS, writes the tokens to ``out[:, step]`` and ``tokens``, whether
any row is still running to ``alive[step]``, and adds one to ``positions``, ``q_start``, ``decode_idx`` and
``step``. ``step`` must lie in [0, max_new) for a token to be recorded: the kernel records none outside it (a
graph replayed past the last token; the reference raises). ``chosen`` (B,) int64, when given, holds the rows'
tokens already chosen (``fuseinfer.ops.sample_tokens``): they are recorded instead of the argmax, and ``scores``
is not read.

On CUDA it is one kernel (``csrc/emit_tokens.cu``) instead of ~13 small ones inside the decode graph; ``scratch``
(:func:`emit_tokens_scratch`, made once per batch size) holds its per-chunk maxima; with ``chosen``, a one-block
kernel does the bookkeeping alone (the greedy kernel stays as it was). Elsewhere it runs
:func:`emit_tokens_ref`.
"""
from __future__ import annotations

import torch

from fuseinfer.core.extension import eager_cuda, extension
from fuseinfer.core.errors import FuseInferError


def emit_tokens_ref(scores, eos, pad: int, tokens, positions, q_start, decode_idx, step, unfinished, out, alive,
                    scratch, chosen=None) -> None:
    """Pure-PyTorch reference, in place (``scratch`` is not used)."""
    picked = scores.argmax(-1) if chosen is None else chosen  # (B,): first maximum, NaN the largest (torch's rule)
    nxt = torch.where(unfinished, picked, pad)
    if eos.numel():
        unfinished &= ~(nxt[:, None] == eos[None]).any(-1)
    out.index_copy_(1, step, nxt[:, None])
    alive.index_copy_(0, step, unfinished.any()[None])
    tokens.copy_(nxt.view_as(tokens))
    positions += 1
    q_start += 1
    decode_idx += 1
    step += 1


_MUTATED = ("tokens", "positions", "q_start", "decode_idx", "step", "unfinished", "out", "alive", "scratch")


@torch.library.custom_op("fuseinfer::emit_tokens", mutates_args=_MUTATED)
def _emit_tokens(scores: torch.Tensor, eos: torch.Tensor, pad: int, tokens: torch.Tensor, positions: torch.Tensor,
                 q_start: torch.Tensor, decode_idx: torch.Tensor, step: torch.Tensor, unfinished: torch.Tensor,
                 out: torch.Tensor, alive: torch.Tensor, scratch: torch.Tensor,
                 chosen: torch.Tensor | None = None) -> None:
    emit_tokens_ref(scores, eos, pad, tokens, positions, q_start, decode_idx, step, unfinished, out, alive, scratch,
                    chosen)


def emit_tokens_scratch(rows: int, device) -> torch.Tensor:
    """Zeroed scratch for ``rows`` rows (one element when the extension is not built); keep it between calls."""
    ext = extension()
    return torch.zeros(ext.emit_tokens_scratch_ints(rows) if ext is not None else 1, dtype=torch.int32,
                       device=device)


def kernel_supports(scores, tokens, positions, q_start, out, scratch, chosen=None) -> bool:
    """Whether the CUDA kernel serves these tensors (else the op runs the reference)."""
    ext = extension(scores.device)
    b = scores.shape[0]
    if chosen is not None and not (chosen.dtype == torch.int64 and chosen.is_contiguous() and chosen.numel() == b
                                   and chosen.device == scores.device):
        return False
    return (ext is not None and scores.dtype == torch.float32 and scores.is_contiguous() and 1 <= b <= 65535
            and scores.shape[1] < 2**31 and all(t.is_contiguous() for t in (tokens, positions, q_start, out))
            and tokens.dtype == positions.dtype == torch.int64 and q_start.dtype == torch.int32
            and scratch.numel() == ext.emit_tokens_scratch_ints(b))


@_emit_tokens.register_kernel("cuda")
def _emit_tokens_cuda(scores, eos, pad, tokens, positions, q_start, decode_idx, step, unfinished, out, alive,
                      scratch, chosen=None):
    if kernel_supports(scores, tokens, positions, q_start, out, scratch, chosen):
        extension().emit_tokens(scores, eos, pad, tokens, positions, q_start, decode_idx, step, unfinished, out,
                                alive, scratch, chosen)
    else:
        emit_tokens_ref(scores, eos, pad, tokens, positions, q_start, decode_idx, step, unfinished, out, alive,
                        scratch, chosen)


@_emit_tokens.register_fake
def _(scores, eos, pad, tokens, positions, q_start, decode_idx, step, unfinished, out, alive, scratch, chosen=None):
    return None


def emit_tokens(scores, eos, pad: int, tokens, positions, q_start, decode_idx, step, unfinished, out, alive,
                scratch, chosen=None) -> None:
    """See the module docstring. scores (B, V) fp32; eos (n,) int64; tokens, positions (B, 1) int64; q_start (B,)
    int32; decode_idx, step (1,) int64; unfinished (B,) bool; out (B, max_new) int64; alive (max_new,) bool;
    chosen None or (B,) int64."""
    b = scores.shape[0]
    if (scores.dim() != 2 or tokens.numel() != b or positions.numel() != b or q_start.shape != (b,)
            or unfinished.shape != (b,) or out.dim() != 2 or out.shape[0] != b or alive.shape != (out.shape[1],)
            or decode_idx.shape != (1,) or step.shape != (1,) or eos.dim() != 1
            or (chosen is not None and chosen.shape != (b,))):
        raise FuseInferError(f"emit_tokens: bad shapes: scores {tuple(scores.shape)}, tokens {tuple(tokens.shape)}, "
                             f"out {tuple(out.shape)}, alive {tuple(alive.shape)}, unfinished {tuple(unfinished.shape)}")
    args = (scores, eos, pad, tokens, positions, q_start, decode_idx, step, unfinished, out, alive, scratch, chosen)
    if eager_cuda(scores):
        _emit_tokens_cuda(*args)
    else:
        torch.ops.fuseinfer.emit_tokens(*args)
