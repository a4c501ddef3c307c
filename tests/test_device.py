"""Device plumbing the loops rely on, checked on the CPU: where input ids go for a model whose parts live on
different devices, and that the loops build their inputs there."""

import copy

import torch

import lookupdec
from lookupdec import LookupDrafter, _device


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


def test_the_loops_feed_the_input_embedding_device_not_model_device(tiny_model):
    # A model spread with device_map reads its ids where its input embedding lives, while model.device may name
    # another device. Here model.device says "meta" (no data there: a tensor built on it cannot be fed), the
    # weights stay where they are: both loops must build every tensor they feed on the embedding's device, and
    # still give plain greedy's tokens.
    model = copy.deepcopy(tiny_model)
    home = _device.input_device(tiny_model)
    model.__class__ = type(f"Misplaced{type(model).__name__}", (type(model),),
                           {"device": property(lambda self: torch.device("meta"))})
    fed = []
    model.register_forward_pre_hook(lambda m, args, kwargs: fed.append(kwargs["input_ids"].device), with_kwargs=True)
    drafter = LookupDrafter(calibrate=False)  # calibrating would time passes: not this test's subject
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8]])
    one = lookupdec.generate(model, prompt, max_new_tokens=12, drafter=drafter)
    two = lookupdec.generate(model, prompt.repeat(2, 1), torch.ones(2, 9, dtype=torch.long), max_new_tokens=12,
                             drafter=drafter)
    plain = tiny_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert one.sequences.cpu().tolist() == plain.tolist()
    assert two.sequences.cpu().tolist() == plain.repeat(2, 1).tolist()
    assert len(fed) > 2 and set(fed) == {home}
