"""What the sampling tests share (test_sampling.py, test_batch.py): the two-sample test, the padding of rows that
ended early, and plain ``model.generate`` sampling, the reference every sampled route is compared with.

The peaky model these run on, and plain sampling's samples of it computed once per session, are conftest's
``peaky`` and ``plain_reference`` fixtures."""

from collections import Counter

import numpy as np
import torch
from scipy import stats

ALPHA = 1e-3  # a correct rule scores above this at every position; the wrong rules score below 1e-6
STEPS = 4  # new tokens per sample: each position is compared on its own
# Plain sampling's reference, per prompt and setting: one batched call, so it is cheap to make it larger than the
# samples of the route under test (one call each). The two-sample test's power goes with 2 / (1 / n_plain + 1 / n),
# the size of two equal samples with the same power: 6000 plain samples against 900 are worth 1565 against 1565.
PLAIN_SAMPLES = 6000


def two_sample_p(a: Counter, b: Counter) -> float:
    """Chi-square test that two samples of tokens come from one distribution; rare tokens pooled."""
    keys = sorted(set(a) | set(b))
    table = np.array([[a.get(k, 0) for k in keys], [b.get(k, 0) for k in keys]], dtype=float)
    total = table.sum(axis=0)
    common = total >= 10
    rows = table[:, common]
    rest = table[:, ~common].sum(axis=1, keepdims=True)
    if rest.sum() > 0:
        rows = np.concatenate([rows, rest], axis=1)
    if rows.shape[1] < 2:
        return 1.0
    return float(stats.chi2_contingency(rows)[1])


def per_position_p(a: torch.Tensor, b: torch.Tensor) -> list:  # a [n_a, STEPS], b [n_b, STEPS]
    return [two_sample_p(Counter(a[:, pos].tolist()), Counter(b[:, pos].tolist())) for pos in range(STEPS)]


def pad(rows: list) -> torch.Tensor:
    """Rows that ended at EOS padded with the pad token (2), as batched plain generation pads them: [n, STEPS]."""
    return torch.tensor([row + [2] * (STEPS - len(row)) for row in rows])


def plain_samples(model, prompt: torch.Tensor, n: int, **warpers) -> torch.Tensor:
    """``n`` samples of plain ``model.generate`` after ``prompt`` [1, prompt_len]: [n, STEPS]. One batched call,
    exact: the rows are the same prompt, so there is no padding, and each row draws its own tokens, distributed as
    one call on one row draws them."""
    torch.manual_seed(1234)
    batch = prompt.repeat(n, 1)
    out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True, max_new_tokens=STEPS,
                         **warpers)
    return pad(out[:, prompt.shape[1]:].tolist())
