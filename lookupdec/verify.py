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

Two ways to run it, chosen by where the logits are (``eager``):

- **Lazy** (CPU logits): processors run one position at a time and stop at the first rejection. A top-p sort over
  a 50k vocabulary costs about a millisecond on a CPU, so processing positions whose tokens are thrown away would
  cost more than drafting saves; and a host read per position costs nothing there.
- **Eager** (accelerator logits): every position is processed at once, without waiting, and the decision needs one
  device-to-host transfer per pass (greedy: the argmax row, compared with the draft on the host; sampling: the
  accepted count and the new token, drawn on the device). Each wait for the device costs more there than the
  extra positions' work. Both give the same greedy verdicts; under sampling both are exact, but they read the
  generator differently, so the lazy path keeps the samples a CPU run gives.

The lazy path processes exactly the positions whose tokens are committed (the accepted ones and the one after
them), in order, as plain decoding does; the eager path also processes rejected positions, which only processors
that hold no state between calls may see (``eager=False`` otherwise; ``lookupdec._transformers.known_stateless``).

Random numbers come from ``generator`` on its own device (a CPU generator works with CUDA logits, and the other
way round); sampling on the logits' device itself needs a generator there (or none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# process(pos, logits_row) -> processed row; pos indexes the draft (0 .. d). Rows are [vocab].
Processor = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafted tokens kept, 0 .. d
    token: int  # the recovered token (accepted < d) or the bonus token (accepted == d)


def verify_greedy(
    logits: torch.Tensor,  # [d + 1, vocab] raw target logits for [last token, x_0 .. x_{d-1}]
    draft: np.ndarray,  # [d] int, on the host
    process: Processor | None = None,
    *,
    eager: bool | None = None,  # None: eager unless the logits are on the CPU
) -> Verdict:
    """Longest prefix of ``draft`` equal to the target's argmax, plus the target's own next token."""
    d = len(draft)
    if eager is None:
        eager = eager_by_default(logits)
    if process is not None and not eager:
        for pos in range(d + 1):
            token = int(process(pos, logits[pos]).argmax())
            if pos == d or token != int(draft[pos]):
                return Verdict(pos, token)
        raise AssertionError("unreachable")
    if process is not None:
        logits = torch.stack([process(pos, logits[pos]) for pos in range(d + 1)])
    return greedy_verdict(logits.argmax(dim=-1).cpu().numpy(), draft)  # the one transfer: d + 1 token ids


def eager_by_default(logits: torch.Tensor) -> bool:
    """The path a verification takes when its caller does not choose (module docstring): eager unless the logits
    are on the CPU. A caller whose processors may hold state passes ``eager=False``: the lazy path processes only
    the positions whose tokens are committed."""
    return logits.device.type != "cpu"


def greedy_verdict(choice: np.ndarray, draft: np.ndarray) -> Verdict:
    """The greedy verdict from the target's choices ``choice`` [d + 1] (argmax of each position, on the host)."""
    d = len(draft)
    mismatch = np.flatnonzero(choice[:d] != draft)
    pos = int(mismatch[0]) if mismatch.size else d
    return Verdict(pos, int(choice[pos]))


def verify_sample(
    logits: torch.Tensor,  # [d + 1, vocab] raw target logits for [last token, x_0 .. x_{d-1}]
    draft: np.ndarray,  # [d] int, on the host
    process: Processor | None = None,
    generator: torch.Generator | None = None,
    *,
    eager: bool | None = None,  # None: eager unless the logits are on the CPU
) -> Verdict:
    """Exact speculative sampling with a point-mass draft (module docstring)."""
    d = len(draft)
    if eager is None:
        eager = eager_by_default(logits)
    if eager:
        return _sample_eager(logits, draft, process, generator)
    for pos in range(d + 1):
        row = logits[pos].float()
        if process is not None:
            row = process(pos, row)
        p = torch.softmax(row, dim=-1)  # [vocab]
        if pos == d:
            return Verdict(d, int(_draw(p, generator)))
        x = int(draft[pos])
        u = _uniform((), generator, p.device)
        if u < p[x]:  # P(accept) = p(x), since u is uniform on [0, 1)
            continue
        # Rejected: recover from p with x removed. p(x) < 1 here (u < 1 = p(x) would have accepted), so the
        # remaining mass is positive.
        p = p.clone()
        p[x] = 0.0
        return Verdict(pos, int(_draw(p / p.sum(), generator)))
    raise AssertionError("unreachable")


def verify_keyed(
    logits: torch.Tensor,  # [d + 1, vocab] raw target logits for [last token, x_0 .. x_{d-1}]
    draft: np.ndarray,  # [d] int, on the host
    process: Processor | None,
    seed: int,
    position: int,  # output position of the pass's first new token (0: the first generated token)
) -> Verdict:
    """Exact sampling whose randomness belongs to the output position, not to the pass: the token at output
    position ``t`` is drawn from ``p_t`` by inverting its cumulative distribution at ``keyed_uniform(seed, t)``,
    and the drafted token there is accepted if and only if it is that token. The accepted token then has
    probability ``p(x)`` and a replacement follows ``p`` with ``x`` removed and renormalised: the rule of
    :func:`verify_sample`, drawn differently. Since ``u`` depends only on ``(seed, t)``, a seed gives the same
    output whatever was drafted and whichever requests shared the pass (the server's per-request ``seed``)."""
    d = len(draft)
    for pos in range(d + 1):
        row = logits[pos].float()
        if process is not None:
            row = process(pos, row)
        p = torch.softmax(row.double(), dim=-1)
        cdf = p.cumsum(0)
        u = torch.tensor([keyed_uniform(seed, position + pos) * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
        token = int(torch.searchsorted(cdf, u, right=True)[0].clamp(max=p.numel() - 1))
        if pos == d or token != int(draft[pos]):
            return Verdict(pos, token)
    raise AssertionError("unreachable")


def keyed_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) fixed by ``(seed, position)`` (numpy's PCG64 seeded with both)."""
    return float(np.random.default_rng([seed & 0xFFFF_FFFF_FFFF_FFFF, position]).random())


def _sample_eager(logits, draft, process, generator) -> Verdict:
    """The same rule on every position at once: ``u_pos < p_pos(x_pos)`` decides each drafted token, the first
    failure (or the end of the draft) is where the pass stops, and the token there is drawn from ``p`` with the
    drafted token removed (the recovered token) or from ``p_d`` (the bonus token). One transfer at the end."""
    d = len(draft)
    rows = logits.float()
    if process is not None:
        rows = torch.stack([process(pos, rows[pos]) for pos in range(d + 1)])
    p = torch.softmax(rows, dim=-1)  # [d + 1, vocab]
    device = p.device
    x = torch.as_tensor(np.asarray(draft, dtype=np.int64)).to(device, non_blocking=True)  # [d]
    accept = _uniform((d,), generator, device) < p[torch.arange(d, device=device), x]  # [d]
    accepted = accept.to(torch.int64).cumprod(0).sum()  # first rejection, or d; stays on the device
    row = p.index_select(0, accepted.view(1))[0].clone()  # p at the stopping position [vocab]
    # Remove the drafted token there, unless the whole draft was accepted (then the bonus comes from p_d as is):
    # position d holds a dummy index whose probability is written back unchanged.
    at = torch.cat([x, x.new_zeros(1)])[accepted]
    row[at] = torch.where(accepted < d, torch.zeros_like(row[at]), row[at])
    token = _draw(row / row.sum(), generator)
    accepted, token = torch.stack([accepted, token.view(())]).tolist()
    return Verdict(accepted, token)


def _same_device(generator: torch.Generator | None, device: torch.device) -> bool:
    return generator is None or generator.device == device


def _uniform(shape: tuple, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Uniform [0, 1) numbers on ``device``, drawn from ``generator`` on the generator's own device."""
    if _same_device(generator, device):
        return torch.rand(shape, generator=generator, device=device)
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index drawn from the distribution ``p`` [vocab] (a 0-d tensor on ``p``'s device). With a generator on
    another device than ``p``, by inverting the cumulative distribution at a uniform drawn from that generator."""
    if _same_device(generator, p.device):
        return torch.multinomial(p, 1, generator=generator)[0]
    cdf = p.cumsum(0)
    u = _uniform((), generator, p.device) * cdf[-1]
    # The first index whose cumulative mass exceeds u: never a token of zero probability.
    return torch.searchsorted(cdf, u.view(1), right=True)[0].clamp(max=p.numel() - 1)
