"""A vLLM ``custom_class`` proposer that drafts nothing: vLLM's speculative path with no drafts, which times that
path alone, without any of lookupdec's code (``python -m benchmarks.serve --servers vllm-zero``).

vLLM imports it by name in its engine processes, in vLLM's own environment: it imports nothing itself."""


class ZeroProposer:
    def __init__(self, vllm_config):
        pass

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load (vLLM's CPU runner calls this on every drafter)."""

    def propose(self, sampled_token_ids, *args, **kwargs) -> list:
        """No draft for any request of the step."""
        return [[] for _ in sampled_token_ids]
