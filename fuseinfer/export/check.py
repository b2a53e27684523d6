"""How close an export's logits are to PyTorch's: the figure behind the tests and bench/ort_accuracy.py.

``logit_errors(directory, fp32_model, lowp_model, device, ids, mask)`` runs the export with
:class:`~fuseinfer.export.ort_runtime.OrtDecoder` twice: one call over the whole sequence (``logits``) and a
prefill of the first ``prompt_len`` tokens followed by one decode step per remaining token (the KV-cache path),
and compares both with the fp32 PyTorch model. The bar is the project's tolerance rule: the export's error against
fp32 within twice the low-precision PyTorch model's own error (same dtype as the export) plus a small atol.
"""
from __future__ import annotations

import torch

from fuseinfer.export.ort_runtime import OrtDecoder


@torch.no_grad()
def logit_errors(directory, fp32_model, lowp_model, device, ids: torch.Tensor, mask: torch.Tensor | None = None,
                 prompt_len: int | None = None, decoder: OrtDecoder | None = None) -> dict:
    """ids, mask (B, S) on ``device``; returns max |error| of ORT (whole sequence, prefill + steps) and of the
    low-precision PyTorch model, both against fp32 over the non-padded positions, and their ratio."""
    b, s = ids.shape
    prompt_len = prompt_len or max(1, s - 8)
    valid = (mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool))  # (B, S)
    ref = fp32_model(input_ids=ids, attention_mask=mask).logits.float()  # (B, S, V)
    lowp = lowp_model(input_ids=ids, attention_mask=mask).logits.float()
    torch_err = (lowp - ref)[valid].abs().max().item()
    dec = decoder or OrtDecoder(directory, device, model=lowp_model)
    full = dec.logits(ids, mask).float()
    assert full.device.type == torch.device(device).type  # the logits stay where the run is
    whole_err = (full - ref)[valid].abs().max().item()
    dec.start(b, s)
    steps = [dec.prefill(ids[:, :prompt_len], None if mask is None else mask[:, :prompt_len]).float().clone()]
    for t in range(prompt_len, s):
        steps.append(dec.step(ids[:, t:t + 1]).float().clone())
    dec.end()
    got = torch.cat(steps, dim=1)  # logits of positions prompt_len - 1 ... S - 1
    steps_err = (got - ref[:, prompt_len - 1:])[valid[:, prompt_len - 1:]].abs().max().item()
    worst = max(whole_err, steps_err)
    return {"ort_max_err": worst, "ort_whole_err": whole_err, "ort_steps_err": steps_err,
            "torch_max_err": torch_err, "ratio_to_torch": worst / torch_err if torch_err else float("inf"),
            "batch": b, "seq": s, "prompt_len": prompt_len, "padded": mask is not None and not bool(mask.all())}


def within_tolerance(errors: dict, atol: float = 1e-2) -> bool:
    """The project's rule for low precision: |ours - fp32| <= 2 |torch_lowprec - fp32| + atol."""
    return errors["ort_max_err"] <= 2 * errors["torch_max_err"] + atol
