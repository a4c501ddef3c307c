"""The acceptance rule: which drafted tokens the target keeps, and the one token it adds.

Notation (fixed for the whole package):

- ``p`` is the target's distribution at a position, *after* the same logits processors and warpers plain
  ``model.generate`` applies there (repetition penalty, temperature, top-k, top-p, min-p, ...).
- ``q`` is the draft's distribution. Lookup drafts are copied, not sampled, so ``q`` is a point mass on the
  drafted token ``x``: ``q(x) = 1``.
- A draft ``x_0 .. x_{d-1}`` is scored in one target pass, which gives ``p_0 .. p_d`` (``p_pos`` conditions on the
  tokens before draft position ``pos``).
- **accepted** tokens: the longest prefix of the draft the rule keeps (``0 .. d`` tokens).
- **recovered** token: on the first rejection at position ``pos``, the token the target puts there instead.
- **bonus** token: when all ``d`` drafted tokens are accepted, one more token drawn from ``p_d``.
  Every pass therefore commits ``accepted + 1`` tokens.

Greedy: accept while ``x_pos == argmax p_pos``; the recovered or bonus token is ``argmax p_pos``. The output is the
plain greedy output, token for token.

Sampling: speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling") accepts
``x`` with probability ``min(1, p(x) / q(x))`` and on rejection samples from ``norm(max(0, p - q))``. With a point
mass ``q`` this becomes: accept ``x`` with probability ``p(x)``; on rejection sample from ``p`` with ``x`` zeroed
and renormalised; if everything is accepted, sample the bonus token from ``p_d``. Each committed token then follows
exactly the distribution plain sampling would have given it.

Processors run lazily, one position at a time, and stop at the first rejection: a top-p sort over a 50k
vocabulary costs about a millisecond, so processing positions whose tokens are thrown away would cost more than
drafting saves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# process(pos, logits_row) -> processed row; pos indexes the draft (0 .. d). Rows are [vocab].
Processor = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafted tokens kept, 0 .. d
    token: int  # the recovered token (accepted < d) or the bonus token (accepted == d)


def verify_greedy(
    logits: torch.Tensor,  # [d + 1, vocab] raw target logits for [last token, x_0 .. x_{d-1}]
    draft: torch.Tensor,  # [d] long, on logits.device
    process: Processor | None = None,
) -> Verdict:
    """Longest prefix of ``draft`` equal to the target's argmax, plus the target's own next token."""
    d = draft.shape[0]
    if process is None:
        # No processor depends on the prefix: one argmax over all rows, one transfer to the host.
        choice = logits.argmax(dim=-1)  # [d + 1]
        if d == 0:
            return Verdict(0, int(choice[0]))
        mismatch = (choice[:d] != draft).nonzero()
        pos = int(mismatch[0, 0]) if mismatch.numel() else d
        return Verdict(pos, int(choice[pos]))
    for pos in range(d + 1):
        token = int(process(pos, logits[pos]).argmax())
        if pos == d or token != int(draft[pos]):
            return Verdict(pos, token)
    raise AssertionError("unreachable")


def verify_sample(
    logits: torch.Tensor,  # [d + 1, vocab] raw target logits for [last token, x_0 .. x_{d-1}]
    draft: torch.Tensor,  # [d] long, on logits.device
    process: Processor | None = None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Exact speculative sampling with a point-mass draft (module docstring)."""
    d = draft.shape[0]
    for pos in range(d + 1):
        row = logits[pos].float()
        if process is not None:
            row = process(pos, row)
        p = torch.softmax(row, dim=-1)  # [vocab]
        if pos == d:
            return Verdict(d, _draw(p, generator))
        x = int(draft[pos])
        u = torch.rand((), generator=generator, device=p.device)
        if u < p[x]:  # P(accept) = p(x), since u is uniform on [0, 1)
            continue
        # Rejected: recover from p with x removed. p(x) < 1 here (u < 1 = p(x) would have accepted), so the
        # remaining mass is positive.
        p = p.clone()
        p[x] = 0.0
        return Verdict(pos, _draw(p / p.sum(), generator))
    raise AssertionError("unreachable")


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))
