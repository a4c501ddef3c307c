"""Device plumbing the loops rely on, checked on the CPU: where input ids go for a model whose parts live on
different devices, and that the loops build their inputs there."""

import torch

import lookupdec
from lookupdec import _device, batch, loop


class _Split(torch.nn.Module):
    """Stands for a model spread with device_map: its input embedding on one device, everything else elsewhere."""

    def __init__(self, embedding_device):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4, device=embedding_device)
        self.device = torch.device("cpu")  # what model.device would say: not where the ids must go

    def get_input_embeddings(self):
        return self.embed


def test_inputs_go_to_the_input_embedding_device():
    assert _device.input_device(_Split("meta")) == torch.device("meta")
    assert _device.input_device(_Split("cpu")) == torch.device("cpu")


def test_synchronize_and_host_buffers_on_a_cpu():
    _device.synchronize(torch.device("cpu"))  # nothing to wait for, and no error
    buffer = _device.host_buffer(5, torch.device("cpu"))
    assert buffer.shape == (5,) and buffer.dtype == torch.long and not buffer.is_pinned()


def test_the_loops_ask_where_inputs_go_and_feed_them_there(tiny_model, monkeypatch):
    # The loop asks _device where inputs go and builds every tensor it feeds there; here that is the CPU, so the
    # check is that the loop honours the answer (every fed id tensor on it) and still matches plain greedy.
    fed = []
    handle = tiny_model.register_forward_pre_hook(lambda m, args, kwargs: fed.append(kwargs["input_ids"].device),
                                                  with_kwargs=True)
    asked = []
    original = _device.input_device

    def spy(model):
        asked.append(model)
        return original(model)

    monkeypatch.setattr(loop, "input_device", spy)
    monkeypatch.setattr(batch, "input_device", spy)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8]])
    try:
        one = lookupdec.generate(tiny_model, prompt, max_new_tokens=12)
        two = lookupdec.generate(tiny_model, prompt.repeat(2, 1), torch.ones(2, 9, dtype=torch.long),
                                 max_new_tokens=12)
    finally:
        handle.remove()
    plain = tiny_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert torch.equal(one.sequences, plain) and torch.equal(two.sequences[0], plain[0])
    assert asked == [tiny_model, tiny_model] and set(fed) == {torch.device("cpu")}
