"""The model behind a run: a loaded (model, tokenizer) that answers prompts greedily, stopping at the closing fence.

This is the only module of the application that imports lookupdec's decoding code, torch or transformers, and it
does so inside functions, so ``lookupdec --help`` stays fast. Tests replace :func:`open_engine` with a stub
wherever the model does not matter.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .prompts import Prompt, extract_block
from .validate import InputError


@dataclass
class Completion:
    answer: str  # the prefill followed by the decoded new tokens
    token_ids: tuple  # the new tokens
    passes: int  # target forward passes (prefill included)
    seconds: float


class TokenProgress:
    """Counts tokens and target passes across a run and draws them on a tqdm bar on stderr (when enabled).

    It duck-types transformers' ``BaseStreamer`` (``put`` / ``end``) rather than subclassing it, so importing the
    command does not import transformers. ``put`` receives the prompt first (skipped), then each pass's new tokens:
    one pass per call for lookupdec and for plain decoding alike, so calls count target passes.
    """

    def __init__(self, total: int, enabled: bool, say: Callable[[str], None] | None = None):
        self.tokens = 0
        self.passes = 0
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))  # write()'s target without a bar
        self._skip_prompt = True
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="tok", file=sys.stderr, dynamic_ncols=True, leave=False,
                             desc="generating", disable=None)  # disable=None: no bar when stderr is not a TTY

    def start_request(self) -> None:
        self._skip_prompt = True

    def put(self, value) -> None:  # value: the prompt [1, prompt_len] first, then [n] new tokens per pass
        if self._skip_prompt:
            self._skip_prompt = False
            return
        n = int(value.numel())
        self.tokens += n
        self.passes += 1
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.tokens / self.passes:.2f} tok/pass", refresh=False)
            self._bar.update(n)

    def end(self) -> None:
        pass

    def add(self, tokens: int, passes: int) -> None:
        """A whole batch at once: ``tokens`` new tokens from ``passes`` batched passes."""
        self.tokens += tokens
        self.passes += passes
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.tokens / max(self.passes, 1):.2f} tok/pass", refresh=False)
            self._bar.update(tokens)

    def write(self, line: str) -> None:
        """A message on stderr that does not tear the bar (without a bar, it goes to ``say``)."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            self._say(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class ModelEngine:
    """A loaded (model, tokenizer) that answers prompts greedily: with lookup drafts, plainly, or with
    transformers' prompt lookup. One ``LookupDrafter`` serves every section of a run, so its rolling cache of
    earlier answers helps later sections (a section's own text is already in its prompt)."""

    def __init__(self, model, tokenizer):
        from lookupdec import LookupDrafter

        self.model = model
        self.tokenizer = tokenizer
        self.drafter = LookupDrafter()
        config = model.config
        self.context = int(getattr(config, "max_position_embeddings", None) or 2048)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def prepare(self, say) -> None:
        """Calibrate the drafter to this model's pass cost by draft length: measured once per model, device and
        thread count (saying so, since it takes a few seconds), then read from the cache."""
        from lookupdec.calibration import calibrate_or_warn

        calibrate_or_warn(self.drafter, self.model, on_measure=lambda: say(
            "measuring this model's pass cost by draft length (once per machine and model, a few seconds)"))

    def encode(self, prompt: Prompt):
        import torch

        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(list(prompt.messages), add_generation_prompt=True, return_dict=True,
                                          return_tensors="pt")["input_ids"]
        else:  # a base model: the text, then the instruction, then the answer
            ids = tok("\n\n".join(m["content"] for m in prompt.messages) + "\n\n", return_tensors="pt")["input_ids"]
        prefill = torch.tensor([tok.encode(prompt.prefill, add_special_tokens=False)], dtype=ids.dtype)
        return torch.cat([ids, prefill], dim=1)

    def complete(self, prompt: Prompt, max_new_tokens: int, method: str = "lookup",
                 streamer: TokenProgress | None = None, drafter=None, trace=None) -> Completion:
        """Greedy answer to ``prompt``, stopping at the closing fence; ``method`` is ``lookup`` (lookupdec, with
        ``drafter`` or the engine's own), ``plain`` (``model.generate``) or ``pld`` (transformers' prompt lookup).
        ``trace`` (a ``TraceRecorder``) records a lookup answer pass by pass."""
        import torch
        from transformers import StoppingCriteriaList

        from lookupdec import generate

        ids = self.encode(prompt)  # [1, prompt_len]
        max_new_tokens = max(1, min(max_new_tokens, self.context - ids.shape[1]))  # a user budget may exceed it
        mask = torch.ones_like(ids)
        stop = StoppingCriteriaList([FenceStop(self.tokenizer)])
        if streamer is not None:
            streamer.start_request()
        started = time.perf_counter()
        with torch.inference_mode(), _transformers_errors_only():
            if method == "lookup":
                out = generate(self.model, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                               drafter=drafter or self.drafter, do_sample=False, stopping_criteria=stop,
                               streamer=streamer, trace=trace)
                sequences, passes = out.sequences, out.stats.target_passes
            else:
                extra = {"prompt_lookup_num_tokens": 10} if method == "pld" else {}
                sequences = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                                do_sample=False, stopping_criteria=stop, streamer=streamer, **extra)
                passes = streamer.passes if streamer is not None else 0
        seconds = time.perf_counter() - started
        new = sequences[0, ids.shape[1]:].tolist()
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return Completion(prompt.prefill + text, tuple(new), passes, seconds)

    def departures(self, prompt: Prompt, done: Completion, limit: int) -> list[str]:
        """Starts of the model's most likely answers to ``prompt`` other than ``done`` (its greedy answer), as
        text to prefill: ``done``'s first ``i`` tokens and then a token the model ranked below the one it chose,
        for every ``i``, the ``limit`` most likely by the log-probability of that start. Tokens that only
        re-spell the chosen one (``" info"`` for ``"info"``) are skipped.

        One forward pass over the prompt and ``done`` scores every start. An edit uses this when the model copied
        a line the instruction is about: its second choice there is usually the edit (``level: info`` ->
        ``debug``; docs/design.md).
        """
        import torch

        ids = self.encode(prompt)  # [1, prompt_len]
        answer = list(done.token_ids)
        if not answer:
            return []
        full = torch.cat([ids, torch.tensor([answer], dtype=ids.dtype)], dim=1)  # [1, prompt_len + answer_len]
        with torch.inference_mode(), _transformers_errors_only():
            logits = self.model(full.to(self.model.device)).logits[0, ids.shape[1] - 1: -1]  # [answer_len, vocab]
        logp = torch.log_softmax(logits.float(), dim=-1).cpu()
        chosen = logp[torch.arange(len(answer)), torch.tensor(answer)]  # [answer_len]
        before = torch.cat([torch.zeros(1), torch.cumsum(chosen, 0)[:-1]])  # log-probability of answer[:pos]
        width = min(limit + 4, logp.shape[1])
        top = torch.topk(logp, width, dim=-1)  # [answer_len, width]
        special = set(self.tokenizer.all_special_ids)
        starts = []
        for pos in range(len(answer)):
            same = self.tokenizer.decode([answer[pos]]).strip()
            for value, token in zip(top.values[pos].tolist(), top.indices[pos].tolist(), strict=True):
                if token == answer[pos] or token in special:
                    continue
                if self.tokenizer.decode([token]).strip() == same:
                    continue
                starts.append((before[pos].item() + value, pos, token))
        starts.sort(key=lambda s: -s[0])
        return [prompt.prefill + self.tokenizer.decode(answer[:pos] + [token], skip_special_tokens=True)
                for _, pos, token in starts[:limit]]

    def complete_many(self, prompts: Sequence[Prompt], budgets: Sequence[int],
                      progress: TokenProgress | None = None, traces=None) -> list[Completion]:
        """Greedy lookup answers to several prompts in one batch (``lookupdec.generate`` on left-padded rows);
        each answer is what :meth:`complete` would give for that prompt and budget alone. ``traces``: one
        ``TraceRecorder`` per prompt, or None."""
        import torch
        from transformers import StoppingCriteriaList

        from lookupdec import generate

        encoded = [self.encode(p)[0] for p in prompts]
        budgets = [max(1, min(b, self.context - len(e))) for b, e in zip(budgets, encoded, strict=True)]
        if any(max(budgets) > self.context - len(e) for e in encoded):
            # One budget serves the batch (rows are cut at their own afterwards): it must fit every row's context.
            return [self.complete(p, b, streamer=progress, **({"trace": traces[i]} if traces else {}))
                    for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))]
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        width = max(len(e) for e in encoded)
        ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(encoded):
            ids[i, width - len(e):] = e
            mask[i, width - len(e):] = 1
        started = time.perf_counter()
        with torch.inference_mode(), _transformers_errors_only():
            out = generate(self.model, ids, attention_mask=mask, max_new_tokens=max(budgets), drafter=self.drafter,
                           do_sample=False, stopping_criteria=StoppingCriteriaList([FenceStop(self.tokenizer)]),
                           trace=traces)
        seconds = time.perf_counter() - started
        done = []
        for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
            row = out.stats.rows[i]
            # A row may run past its own budget while others need more: cut it where it alone would have stopped.
            new = out.sequences[i, width: width + row.new_tokens].tolist()[:budget]
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            done.append(Completion(prompt.prefill + text, tuple(new), row.target_passes, seconds))
        if progress is not None:
            progress.add(sum(len(c.token_ids) for c in done), out.stats.target_passes)
        return done


@contextlib.contextmanager
def _transformers_errors_only():
    """transformers warns that no attention mask was passed (lookupdec's ``resolve_generation`` tells it so even
    when one was); on a terminal that reads like a problem with the user's file, so only errors are shown."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


class FenceStop:
    """Stops generation once the answer closes its fenced block; without it the model repeats the block until
    the token budget runs out. It looks at the last few tokens for three backticks that do not open a block
    (an opening fence is followed by its language, ```yaml), so it needs no prompt length and serves every row
    of a batch: the prefilled opening fence does not count."""

    _CLOSING = re.compile(r"```(?![A-Za-z])")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, input_ids, scores=None, **kwargs):  # input_ids [batch, length] -> [batch] bool
        import torch

        return torch.tensor([self._closes(row[-4:].tolist()) for row in input_ids], dtype=torch.bool,
                            device=input_ids.device)

    def _closes(self, tail: list) -> bool:
        # Only a fence that the newest token completes counts: the prompt's last tokens (the prefilled first line,
        # which may itself hold backticks) are in the window too.
        before = len(self.tokenizer.decode(tail[:-1]))
        return any(m.end() > before for m in self._CLOSING.finditer(self.tokenizer.decode(tail)))


def open_engine(name: str | None, progress: bool, device: str = "auto", dtype: str = "default") -> ModelEngine:
    """Load the model (on ``device``, in ``dtype``; see ``lookupdec.models.load_model``) and wrap it; InputError
    (exit code 2) saying why it cannot be loaded. Tests replace this with a stub engine."""
    from lookupdec import models

    try:
        model, tokenizer = models.load_model(name, device=device, dtype=dtype, progress=progress)
    except models.ModelLoadError as err:
        raise InputError(str(err)) from None
    return ModelEngine(model, tokenizer)


def compare_methods(engine, completions: Sequence[tuple], say: Callable[[str], None]) -> None:
    """``--compare``: time lookupdec, plain greedy decoding and transformers' prompt lookup on the run's prompts and
    budgets (``completions``: ``(Prompt, budget, Completion)`` of every request of the run), and say the speedups.

    The run itself warmed everything up; the three are then timed interleaved, prompt by prompt, lookupdec with a
    fresh drafter (so its rolling cache starts empty, as in the run, and has not seen these answers). Answers are
    compared as extracted blocks: transformers' assisted loop checks stopping criteria only after a whole
    accepted draft, so prompt lookup may run a few tokens past the closing fence.
    """
    from lookupdec import LookupDrafter

    drafter = LookupDrafter()
    times = {"lookup": 0.0, "plain": 0.0, "pld": 0.0}
    differ = []
    for prompt, budget, done in completions:
        for method in times:
            other = engine.complete(prompt, budget, method=method, drafter=drafter)
            times[method] += other.seconds
            if extract_block(other.answer)[0] != extract_block(done.answer)[0] and method not in differ:
                differ.append(method)
    ours, plain, pld = times["lookup"], times["plain"], times["pld"]
    names = {"lookup": "lookupdec", "plain": "plain decoding", "pld": "prompt lookup"}
    note = f"; note: {' and '.join(names[m] for m in differ)} gave different text" if differ else "; same text"
    say(f"compare: lookupdec {ours:.1f} s, plain {plain:.1f} s ({plain / max(ours, 1e-9):.2f}x), "
        f"prompt lookup {pld:.1f} s ({pld / max(ours, 1e-9):.2f}x){note}")
