"""Studies that replay cached greedy outputs through lookupdec's drafter (``python -m research.simulate``)."""
