"""dfm/platform/torch_api.py: the innermost saved-tensor hooks, on this torch and on a torch whose
private function takes no argument."""

import torch

from dfm.platform.torch_api import top_saved_tensors_hooks


def pack(t):
    return t


def unpack(t):
    return t


def test_top_saved_tensors_hooks_sees_the_innermost_hooks():
    assert top_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert top_saved_tensors_hooks() == (pack, unpack)


def test_top_saved_tensors_hooks_on_a_torch_without_the_argument(monkeypatch):
    def without_argument():
        return (pack, unpack)

    monkeypatch.setattr(torch._C._autograd, "_top_saved_tensors_default_hooks", without_argument, raising=False)
    assert top_saved_tensors_hooks() == (pack, unpack)
