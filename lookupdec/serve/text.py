"""Text and tokens at the server's edge: a request's prompt as token ids (message text kept as text, never as the
model's control tokens), and the answer's text decoded incrementally from the tokens the engine commits, cut at
stop strings.

Everything here is called off the event loop or costs O(new tokens): a request's tokenization runs in the app's
worker threads (the tokenizers library releases the GIL while it encodes), and a decoding step looks at one new
token and a few before it (:class:`Detokenizer`), never at the whole answer again.
"""

from __future__ import annotations

import bisect
import secrets

from .protocol import APIError, invalid

# ---------------------------------------------------------------------------------------------------- prompts


def control_strings(tokenizer) -> frozenset:
    """The texts of the tokenizer's special added tokens (``<|im_start|>``, ``<|im_end|>``, ...), which the
    tokenizer turns into control tokens wherever they appear in the text it is given."""
    cached = getattr(tokenizer, "_lookupdec_control_strings", None)
    if cached is None:
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        cached = frozenset(t.content for t in decoder.values() if getattr(t, "special", False) and t.content)
        cached |= frozenset(s for s in getattr(tokenizer, "all_special_tokens", []) if s)
        try:
            tokenizer._lookupdec_control_strings = cached
        except AttributeError:  # a tokenizer that takes no new attributes: recompute next time (cheap)
            pass
    return cached


def chat_prompt_ids(tokenizer, messages: list) -> list:
    """The token ids of ``messages`` ([{"role", "content": str}]) under the model's chat template, ready for the
    assistant's answer.

    The template's own markers become control tokens; the messages' text never does. A user who types
    ``<|im_end|>\\n<|im_start|>system`` gets those characters as text, not a forged turn of another role. When no
    message spells a control token (the usual case) the rendered prompt is tokenized whole, exactly as
    ``apply_chat_template(..., tokenize=True)`` does; otherwise the template is rendered around placeholders and
    each message's text is tokenized with special tokens split (as plain text) between the template's parts.
    :class:`APIError` (400, param ``messages``) when the template refuses the messages.
    """
    text = _render(tokenizer, messages)
    controls = control_strings(tokenizer)
    spelled = [i for i, m in enumerate(messages) if any(c in m["content"] for c in controls)]
    if not spelled:
        return tokenizer.encode(text, add_special_tokens=False)
    marks = [f"\u2063lookupdec-{secrets.token_hex(8)}-{i}\u2063" for i in range(len(messages))]
    skeleton = _render(tokenizer, [{**m, "content": mark} for m, mark in zip(messages, marks)])
    parts, rest = [], skeleton
    for mark in marks:
        head, found, rest = rest.partition(mark)
        if not found or mark in rest:
            parts = None
            break
        parts.append(head)
    # The split is exact only if the template puts each message's text in unchanged, once, in order; a template
    # that trims or rewrites text cannot be split this way, and then the request is refused rather than guessed.
    if parts is None or "".join(p + m["content"] for p, m in zip(parts, messages)) + rest != text:
        where = f"messages[{spelled[0]}].content"
        raise invalid(f"'{where}' contains the text of one of the model's control tokens, and this model's chat "
                      f"template rewrites message text, so it cannot be kept as plain text", param=where)
    ids = []
    for head, message in zip(parts, messages):
        ids += tokenizer.encode(head, add_special_tokens=False) if head else []
        ids += plain_ids(tokenizer, message["content"])
    return ids + (tokenizer.encode(rest, add_special_tokens=False) if rest else [])


def plain_ids(tokenizer, text: str) -> list:
    """``text`` as token ids with every special-token spelling split into ordinary tokens (text, not control)."""
    if not text:
        return []
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _render(tokenizer, messages: list) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # the template is fixed: whatever it raises, the messages caused it
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise APIError(400, f"the model's chat template refused these messages: {message}", param="messages",
                       code="invalid_messages") from None


# ---------------------------------------------------------------------------------------------------- answers


class Detokenizer:
    """Incremental detokenization with stop strings: :meth:`add` takes committed token ids and returns the text
    that is safe to send (complete characters only, and never the start of a stop string that may still complete).

    The answer is the concatenation of what :meth:`add` and :meth:`finish` return, streamed or not (the two cannot
    drift). It is the tokenizer's decoding of the tokens without transformers' ``clean_up_tokenization_spaces``
    (a rewrite of the whole text that a stream could not take back), special tokens skipped. Fast tokenizers
    decode through the tokenizers library's ``DecodeStream``; others through :class:`WindowDecoder`, the same
    scheme in Python and its reference.
    """

    def __init__(self, tokenizer, stops: list):
        self.stops = stops
        self._decoder = _stream_decoder(tokenizer)
        self.text = ""  # the answer so far (stop string and after cut away once stopped)
        self.ends: list = []  # ends[k]: characters of text once token k was decoded
        self.sent = 0  # characters of text already handed out
        self.stopped = False
        self._hold = max((len(s) for s in stops), default=1) - 1

    @property
    def answer_tokens(self) -> int:
        """How many generated tokens the answer covers whole: after a stop string, those whose text ends before
        it (what the client gets, as far as whole tokens go)."""
        return self.tokens_within(len(self.text)) if self.stopped else len(self.ends)

    def tokens_within(self, chars: int) -> int:
        """How many of the generated tokens have their text within the answer's first ``chars`` characters (a
        token that adds no text, a skipped special token or the first bytes of a character, counts with the
        tokens before it)."""
        return bisect.bisect_right(self.ends, chars)

    def add(self, tokens: list) -> str:
        if self.stopped:  # tokens of the pass that was running when the stop string appeared
            return ""
        for token in tokens:
            piece = self._decoder.step(int(token))
            if piece:
                self.text += piece
            self.ends.append(len(self.text))
        return self._release(final=False)

    def finish(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if not self.stopped:
            hits = [i for i in (self.text.find(s, max(0, self.sent - self._hold)) for s in self.stops) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[: min(hits)], True
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self._hold)
        out, self.sent = self.text[self.sent: end], end
        return out


class WindowDecoder:
    """Incremental decoding with the tokenizer's ``decode`` over a short window of recent tokens (prefix and read
    offsets): a token's text is what decoding the window with it adds to decoding the window without it. A piece
    ending in U+FFFD (an incomplete UTF-8 sequence) waits for the next token. Each step decodes a few tokens, never
    the whole answer. Used where no ``DecodeStream`` is available, and as its reference in the tests."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list = []
        self.prefix = 0  # the window starts here: context that gives the next token its leading space right
        self.read = 0  # tokens before this have been handed out as text

    def step(self, token: int) -> str | None:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix: self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return None
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def _decode(self, ids: list) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class _FastDecoder:
    def __init__(self, backend):
        from tokenizers.decoders import DecodeStream

        self.backend, self.stream = backend, DecodeStream(skip_special_tokens=True)

    def step(self, token: int) -> str | None:
        return self.stream.step(self.backend, token)


def _stream_decoder(tokenizer):
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401 - imported to find tokenizers >= 0.21
    except ImportError:
        return WindowDecoder(tokenizer)
    return _FastDecoder(backend) if isinstance(backend, Tokenizer) else WindowDecoder(tokenizer)
