"""Where lookupdec's greedy output parts from plain greedy decoding in a reduced precision, and by how much: what
test_precision.py measures and asserts on.

Both decoders run on one prompt in the model's dtype. Plain's raw logits are ``model.generate``'s
(``output_logits``); lookupdec's are those of its verification passes, replayed from its trace with the loop's own
forward call and cache (``lookupdec._transformers``), and checked to reproduce every token lookupdec chose.

Units: ``u`` is the dtype's spacing at the largest |logit| of plain's row (bf16: ``2^(floor(log2|x|) - 7)``), not
at the top logit, since the rounding a logit picks up comes through the hidden state and the head and so scales
with the row's overall size. benchmarks/precision.py measures the same quantities on the benchmark suites.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import lookupdec
from lookupdec import TraceRecorder
from lookupdec._device import input_device
from lookupdec._transformers import forward_params, rollback_cache, target_forward

# The near-tie bound K, in u: twice the largest change a verification pass made to plain's top-2 gap in bf16 on
# the benchmark prompts (4 u; the median was 0.5 u; benchmarks/RESULTS.md).
BOUND_ULPS = 8


def ulp(x: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype``'s numbers at ``|x|``: ``eps * 2^floor(log2|x|)``."""
    x = abs(float(x))
    if x == 0.0:
        return float(torch.finfo(dtype).tiny)
    _, exp = math.frexp(x)  # x = m * 2^exp with 0.5 <= m < 1, so floor(log2 x) = exp - 1
    return float(torch.finfo(dtype).eps) * 2.0 ** (exp - 1)


def spacing(row: torch.Tensor, dtype: torch.dtype) -> float:  # row [vocab]
    """``u`` of one row of logits: the spacing of ``dtype`` at its largest |logit|."""
    return ulp(float(row.abs().max()), dtype)


def top2(row: torch.Tensor) -> tuple:  # row [vocab]
    """(top token, runner-up token, the gap between their logits)."""
    values, indices = row.float().topk(2)
    return int(indices[0]), int(indices[1]), float(values[0] - values[1])


@dataclass
class Comparison:
    """Plain and lookupdec on one prompt in one dtype."""

    plain: list = field(repr=False)  # plain's new tokens
    lookup: list = field(repr=False)  # lookupdec's new tokens
    passes: list = field(repr=False)  # lookupdec's passes, the prefill first: [(draft, accepted, token), ...]
    replay_faithful: bool | None = None  # every replayed argmax is the token lookupdec chose (None: not measured)
    # At each position before the first difference: how much the verification pass changed the gap between
    # plain's top two logits a, b: |(v(a) - v(b)) - (p(a) - p(b))| / u.
    gap_change_ulps: list = field(default_factory=list, repr=False)
    divergence_gap_ulps: float | None = None  # plain's top-2 gap / u where the outputs part (None: they do not)

    @property
    def matched(self) -> int:
        """New tokens equal before the first difference (all of them when identical)."""
        n = min(len(self.plain), len(self.lookup))
        return next((t for t in range(n) if self.plain[t] != self.lookup[t]), n)

    @property
    def identical(self) -> bool:
        return self.plain == self.lookup

    @property
    def drafted(self) -> int:
        """Drafted tokens, each verified in a pass of more than one row."""
        return sum(len(draft) for draft, _, _ in self.passes)

    @property
    def accepted(self) -> int:
        return sum(accepted for _, accepted, _ in self.passes)


def compare(model, ids: torch.Tensor, max_new_tokens: int, drafter, *, deep: bool = True) -> Comparison:
    """Plain greedy ``model.generate`` and ``lookupdec.generate`` with ``drafter`` on ``ids`` [1, prompt_len];
    with ``deep``, the replay and the gaps along the common prefix and where the outputs part."""
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, return_dict_in_generate=True, output_logits=True)
        plain_logits = torch.cat([step.float().cpu() for step in out.logits])  # [new, vocab]; bf16 -> fp32 exact
        trace = TraceRecorder()
        ours = lookupdec.generate(model, ids, torch.ones_like(ids), max_new_tokens=max_new_tokens, drafter=drafter,
                                  trace=trace)
    result = Comparison(out.sequences[0, ids.shape[1]:].tolist(), ours.sequences[0, ids.shape[1]:].tolist(),
                        [(list(s.draft), s.accepted, s.token) for s in trace.steps])
    if not deep:
        return result
    t = result.matched
    upto = min(t, len(result.plain) - 1, len(result.lookup) - 1)
    verify, result.replay_faithful = replay(model, ids, result.passes, upto)
    dtype = model.dtype
    for pos in range(min(t, upto + 1)):
        a, b, _ = top2(plain_logits[pos])
        delta = verify[pos, [a, b]] - plain_logits[pos, [a, b]]  # [2]
        result.gap_change_ulps.append(abs(float(delta[0] - delta[1])) / spacing(plain_logits[pos], dtype))
    if t < min(len(result.plain), len(result.lookup)):
        row = plain_logits[t]
        result.divergence_gap_ulps = top2(row)[2] / spacing(row, dtype)
    return result


def replay(model, ids: torch.Tensor, passes: list, upto: int) -> tuple:
    """The logits lookupdec's passes gave at new-token positions ``0 .. upto`` ([upto + 1, vocab], fp32, on the
    CPU), by running its passes again as its loop runs them, and whether every replayed argmax is the token it
    chose."""
    rows, faithful, last = [], True, None
    device, params = input_device(model), forward_params(model)
    cache = rollback_cache(model)
    with torch.inference_mode():
        for draft, accepted, token in passes:
            feed = ids if last is None else torch.tensor([[last] + draft])  # the prefill, then [last, draft...]
            keep = 1 if last is None else len(draft) + 1
            logits = target_forward(model, feed.to(device), cache, keep, params)[0].float().cpu()  # [keep, vocab]
            if last is not None:
                cache.crop(accepted - len(draft))
            choice = logits.argmax(dim=-1).tolist()
            faithful &= choice[:accepted] == draft[:accepted] and choice[accepted] == token
            rows.extend(logits[: accepted + 1])
            last = token
            if len(rows) > upto:
                break
    return torch.stack(rows[: upto + 1]), faithful
