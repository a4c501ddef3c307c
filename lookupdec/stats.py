"""What :func:`lookupdec.generate` returns: the sequences, and the figures of the run."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerationStats:
    target_passes: int = 0  # target forward passes, the prefill included
    new_tokens: int = 0
    # accepted_per_position[pos]: drafts whose token at draft position pos was accepted;
    # drafted_per_position[pos]: drafts that had a token at position pos.
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_seconds: float = 0.0  # proposing drafts and updating the drafter
    model_seconds: float = 0.0  # target forward passes (prefill included)
    total_seconds: float = 0.0
    # The figures of each row, in the order of input_ids (one for a batch of one). The totals above count each
    # batched pass once (target_passes, model_seconds) and sum the rows' tokens.
    rows: list[GenerationStats] = field(default_factory=list)

    @property
    def tokens_per_pass(self) -> float:
        """New tokens per target pass, the target's own token of each pass (recovered or bonus) included."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def record(self, draft_len: int, accepted: int) -> None:
        """One verified draft of ``draft_len`` tokens, of which the first ``accepted`` were kept."""
        self._add_positions([1] * draft_len, [1] * accepted)
        self.drafted_tokens += draft_len
        self.accepted_tokens += accepted

    def add_row(self, row: GenerationStats) -> None:
        """Fold one row's token figures into a batch's totals (its passes and times are the batch's own)."""
        self.new_tokens += row.new_tokens
        self.drafted_tokens += row.drafted_tokens
        self.accepted_tokens += row.accepted_tokens
        self._add_positions(row.drafted_per_position, row.accepted_per_position)

    def _add_positions(self, drafted, accepted) -> None:
        while len(self.drafted_per_position) < len(drafted):
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for pos, n in enumerate(drafted):
            self.drafted_per_position[pos] += n
        for pos, n in enumerate(accepted):
            self.accepted_per_position[pos] += n


@dataclass
class LookupOutput:
    sequences: torch.LongTensor  # [batch, prompt_len + new_tokens], like model.generate
    stats: GenerationStats
    # Why each row ended, in the order of input_ids: "stop" (an EOS token, a stop string or a stopping criterion)
    # or "length" (max_new_tokens), as OpenAI's API names them.
    finish_reasons: list[str] = field(default_factory=list)
