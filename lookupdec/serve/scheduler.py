"""The server's prefill scheduler: requests queue to join a running :class:`~lookupdec.batch.BatchRun`, and their
prompts are prefilled between its decoding steps, in chunks sized by time, so that a long prompt neither stalls the
running requests for its whole prefill nor waits for them to finish.

A pass pays a fixed part whatever its width (on a CPU, reading every weight once, and attending over the context
already cached: ~0.05-0.1 s for SmolLM2-135M in fp32 on 2 cores, more than a step of a short request), so chunks
are sized by time, from the last prefill pass's rate (its tokens per second); docs/design.md, "Chunked prefill",
has the measurements behind each rule:

- While rows decode, a long prompt is prefilled on credit: each decoding step earns :data:`BUSY_STEP_SHARE` of
  its own time, and a chunk runs once the credit pays for :data:`CHUNK_MIN` tokens at that rate, spending what the
  chunk measured (a chunk that overruns leaves a debt). The running requests so decode at about
  ``1 + BUSY_STEP_SHARE`` times their pace alone, however dear a pass is (a chunk after every step would cost each
  step a whole pass's fixed part). The credit starts at zero when rows start decoding and holds at most
  :data:`BUSY_CHUNK_S`, so a chunk never delays a step by much more than that.
- While none does, :data:`LONE_CHUNK_S` seconds' worth, and at least :data:`LONE_CHUNK_MIN` tokens: a request that
  arrives meanwhile waits about that long, not for the whole prompt, and a prompt that fits (every prompt on a GPU;
  on a CPU a few hundred tokens) is prefilled in one pass. The floor is there because the fixed part grows with the
  context a pass attends to: late in a long prompt, chunks cut to the time budget would shrink to a handful of
  tokens, each paying the whole fixed part.
- A prompt of at most :data:`WHOLE_PROMPT` tokens is prefilled in one pass whatever the budget, and needs no
  credit: its neighbours wait one pass. Cut into step-sized chunks, each a pass that reads every weight, such
  prompts would cost far more than they save.

Chunking changes no output (``batch.py``): a chunk's queries see the keys before it and its own causally, as in
one pass.
"""

from __future__ import annotations

from ..batch import BatchRun, Row

CHUNK_MIN = 16
CHUNK_MAX = 512
BUSY_STEP_SHARE = 0.25
BUSY_CHUNK_S = 0.2
WHOLE_PROMPT = 512
LONE_CHUNK_S: float | None = 0.25  # None: whole prompts (one that arrives meanwhile waits for the whole prefill)
LONE_CHUNK_MIN = 48
_CHUNK_FIRST = 128  # the budgets before any prefill pass was timed
_LONE_FIRST = 512


class PrefillScheduler:
    """The rows waiting to join ``run`` (:meth:`enqueue`), and the prefill work done for them between steps
    (:meth:`prefill_pending`); :meth:`step` steps the run and earns the credit that pays for chunks beside it."""

    def __init__(self, run: BatchRun):
        self.run = run
        self.joining: list[Row] = []  # rows whose prompt is being prefilled, oldest first
        self.credit = 0.0  # seconds of prefill the decoding steps have paid for (busy_budget)
        self.rate: float | None = None  # prompt tokens per second of the last prefill pass

    @property
    def rows(self) -> list[Row]:
        """The running rows."""
        return self.run.rows

    def enqueue(self, row: Row) -> None:
        """Queue ``row`` to be prefilled by :meth:`prefill_pending`, which adds it to the batch once its prompt is
        in."""
        self.run.check_room(row, self.joining)
        self.joining.append(row)

    def busy_budget(self) -> int:
        """Prompt tokens a round of prefill may spend while rows decode: what the credit the steps earned pays
        for at the last prefill pass's rate, or 0 while that is under :data:`CHUNK_MIN` tokens (a pass that
        reads every weight for a handful of tokens would cost the running rows more than it moves the prompt)."""
        if self.rate is None:
            return _CHUNK_FIRST
        n = int(min(self.credit * self.rate, CHUNK_MAX))
        if n >= CHUNK_MIN or self.credit >= BUSY_CHUNK_S:  # the second: a prefill slower than CHUNK_MIN
            return max(n, CHUNK_MIN)  # tokens per BUSY_CHUNK_S still moves
        return 0

    def lone_budget(self) -> int | None:
        """Prompt tokens a round of prefill may spend while no row decodes (:data:`LONE_CHUNK_S`); None: all of
        them (also for a run that holds one row at a time, which has nothing else to run meanwhile)."""
        if self.run.one_at_a_time or self.run.static_slots is not None or LONE_CHUNK_S is None:
            return None
        if self.rate is None:
            return _LONE_FIRST
        return int(max(self.rate * LONE_CHUNK_S, LONE_CHUNK_MIN))

    def prefill_pending(self) -> list[Row]:
        """One round of prefill work, to run between two steps. A cancelled row stops prefilling at once. Then the
        queued prompts, the shortest remainder first (the oldest first among equals), get passes until the round's
        budget is spent: :meth:`busy_budget` while rows decode (it may be 0: the steps have not yet paid for a
        chunk), else :meth:`lone_budget` (until a row joins). A prompt of at most :data:`WHOLE_PROMPT` tokens
        goes in one pass whatever the budget. No tail chunk under :data:`CHUNK_MIN` tokens runs after another
        pass of the round. A prompt whose prefill completes joins the batch, its first token picked as a
        single-row generation picks it.

        Returns the rows that ended here: cancelled ones (``finish_reason`` ``"cancelled"``) and failed ones
        (:attr:`Row.error` set; the batch is as it was)."""
        ended = []
        for row in [row for row in self.joining if row.cancelled]:
            self._unqueue(row)
            row.finish_reason = "cancelled"
            ended.append(row)
        if not self.run.rows:
            self.credit = 0.0  # credit is earned by steps beside a prefill, from when they start
        spent = 0
        for row in sorted(self.joining, key=lambda row: row.prompt_len - row.prefilled):
            remaining = row.prompt_len - row.prefilled
            busy = bool(self.run.rows)
            budget = self.busy_budget() if busy else self.lone_budget()
            whole = budget is None or (row.prefilled == 0 and row.prompt_len <= WHOLE_PROMPT)
            n = remaining if whole else min(remaining, budget - spent)
            if n <= 0 or (spent and n < min(remaining, CHUNK_MIN)):
                continue  # a whole prompt later in the order still goes
            try:
                joined = self.run.prefill_chunk(row, n)
            except Exception as err:  # the joining row's own failure: the batch goes on
                self._unqueue(row)
                row._fail(err)
                ended.append(row)
                continue
            seconds = self.run.last_pass_seconds
            if seconds > 0:
                self.rate = n / seconds
            if joined:
                self.joining.remove(row)
            spent += n
            if busy and not whole:
                self.credit -= seconds  # what the chunk took, overrun included
        return ended

    def step(self) -> list[Row]:
        """:meth:`BatchRun.step`; a decoding pass beside a prompt being prefilled earns :data:`BUSY_STEP_SHARE` of
        its time as credit (:meth:`busy_budget`)."""
        passes = self.run.stats.target_passes
        ended = self.run.step()
        if self.run.stats.target_passes != passes:  # a decoding pass ran (none when every row ended)
            self.credit = min(self.credit + BUSY_STEP_SHARE * self.run.last_pass_seconds, BUSY_CHUNK_S) \
                if self.joining else 0.0
        return ended

    def cut(self) -> list[Row]:
        """End every row, running or being prefilled, and return them (the server is shutting down): what the
        running rows generated joins the rolling cache (:meth:`BatchRun.cut`)."""
        joining, self.joining = self.joining, []
        for row in joining:
            row.prefill_cache = None
        return self.run.cut() + joining

    def _unqueue(self, row: Row) -> None:
        self.joining.remove(row)
        row.prefill_cache = None
