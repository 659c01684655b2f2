"""Importing dfm's trainer does not import torch.compile's machinery: megatron-core's fusions are
compiled on their first call instead of at import (dfm/platform/import_cost.py)."""

from __future__ import annotations

import subprocess
import sys

import torch

from dfm.platform.import_cost import compile_on_first_call

PROBE = """
import sys
import dfm.training.pretrain
import megatron.core.jit
from megatron.core.fusions.fused_bias_geglu import bias_geglu
print('torch._dynamo' in sys.modules, megatron.core.jit.jit_fuser.__name__, bias_geglu.__wrapped__.__name__)
"""


def test_the_trainer_imports_without_dynamo_and_megatron_fusions_compile_later():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.split() == ["False", "compile_on_first_call", "bias_geglu"]


def test_the_deferred_decorator_compiles_once_on_the_first_call(monkeypatch):
    compiled = []

    def fake_compile(function):
        compiled.append(function)
        return lambda *args: function(*args) * 2

    monkeypatch.setattr(torch, "compile", fake_compile)

    def double_plus_one(x):
        return x + 1

    deferred = compile_on_first_call(double_plus_one)
    assert compiled == [] and deferred.__wrapped__ is double_plus_one
    assert deferred(1) == 4 and deferred(2) == 6
    assert compiled == [double_plus_one]
