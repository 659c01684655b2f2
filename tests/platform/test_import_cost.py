"""Importing dfm's trainer does not import torch.compile's machinery nor run wandb's or boto3's code:
megatron-core's fusions are compiled on their first call, wandb and boto3 run on their first use
(dfm/platform/import_cost.py)."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dfm.platform.import_cost import compile_on_first_call

WANDB_PROBE = """
import sys
import dfm.training.pretrain
import megatron.core.timers
print('wandb.sdk' in sys.modules, type(sys.modules['wandb']).__name__)
assert type(sys.modules['multistorageclient']).__name__ == '_RunsOnFirstUse'
{first_use}
print('wandb.sdk' in sys.modules, type(sys.modules['wandb']).__name__, megatron.core.timers.wandb.Image.__name__)
"""

PROBE = """
import sys
import dfm.training.pretrain
import megatron.core.jit
from megatron.core.fusions.fused_bias_geglu import bias_geglu
print('torch._dynamo' in sys.modules, megatron.core.jit.jit_fuser.__name__, bias_geglu.__wrapped__.__name__)
"""


# One fresh interpreter imports the trainer (what every probe starts with, ~7 CPU s), then runs each probe in
# a forked child of its own: each sees the state right after that import, as a fresh ``python -c`` would.
FORKED_PROBES = """
import json, os, sys, traceback
import dfm.training.pretrain
outputs = []
for code in json.loads(sys.stdin.read()):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        sys.stdout = os.fdopen(write, "w")
        try:
            exec(compile(code, "<probe>", "exec"), {"__name__": "__main__"})
            status = 0
        except BaseException:
            traceback.print_exc(file=sys.stdout)
            status = 1
        sys.stdout.flush()
        os._exit(status)
    os.close(write)
    with os.fdopen(read) as output:
        text = output.read()
    outputs.append([text, os.waitpid(pid, 0)[1]])
print(json.dumps(outputs))
"""


@pytest.fixture(scope="module")
def probes() -> dict[str, list[str]]:
    """{probe code: the words it printed}, for every probe of this file."""
    codes = [
        PROBE,
        BOTO3_PROBE,
        *(WANDB_PROBE.format(first_use=use) for use in FIRST_USES),
        *(OPTIMIZER_PROBE.format(patched=flag) for flag in (True, False)),
    ]
    done = subprocess.run(
        [sys.executable, "-c", FORKED_PROBES], input=json.dumps(codes), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = json.loads(done.stdout.splitlines()[-1])
    for code, (text, status) in zip(codes, outputs, strict=True):
        assert status == 0, f"{code}\n{text}"
    return {code: text.split() for code, (text, _) in zip(codes, outputs)}


def test_the_trainer_imports_without_dynamo_and_megatron_fusions_compile_later(probes):
    assert probes[PROBE] == ["False", "compile_on_first_call", "bias_geglu"]


FIRST_USES = ("import wandb; wandb.init", "import wandb.sdk")


@pytest.mark.parametrize("first_use", FIRST_USES)
def test_wandb_runs_on_first_use_whichever_way_it_comes(probes, first_use):
    """megatron-core's ``import wandb`` leaves wandb's code unrun; its first attribute, or a submodule
    imported first, runs it, and megatron's own reference to wandb is then the loaded module."""
    before_and_after = probes[WANDB_PROBE.format(first_use=first_use)]
    assert before_and_after == ["False", "_RunsOnFirstUse", "True", "module", "Image"]


BOTO3_PROBE = """
import sys
import dfm.training.pretrain
from tensorboard.compat.tensorflow_stub.io import gfile
print(type(sys.modules['boto3']).__name__, 's3transfer' in sys.modules, gfile.S3_ENABLED)
print(gfile.boto3.client.__name__, 's3transfer' in sys.modules)
"""


OPTIMIZER_PROBE = """
import sys
import torch
import dfm.training.pretrain
from dfm.platform import compat

if {patched}:
    compat.install()
torch.manual_seed(0)
weight = torch.nn.Parameter(torch.randn(8))
optimizer = torch.optim.AdamW([weight], lr=0.1)
for _ in range(2):
    weight.grad = torch.randn(8)
    with torch.enable_grad():
        optimizer.step()  # in place on a leaf that requires grad: only legal under the step's no_grad
    optimizer.zero_grad()
optimizer.load_state_dict(optimizer.state_dict())
print('torch._dynamo' in sys.modules, *weight.tolist())
"""


def test_torch_optimizers_build_and_step_without_importing_dynamo(probes):
    """A training rank's optimizer (built, stepped, zeroed, saved and loaded) leaves dynamo unimported
    under dfm's patches, with torch's own update to the bit; torch's own methods import it."""
    patched, unpatched = (probes[OPTIMIZER_PROBE.format(patched=flag)] for flag in (True, False))
    assert patched[0] == "False" and unpatched[0] == "True"
    assert patched[1:] == unpatched[1:]


@pytest.mark.parametrize("imported", [False, True])
def test_optimizer_methods_call_torchs_decorated_method_once_dynamo_is_imported(monkeypatch, imported):
    """Before dynamo is imported the undecorated method runs; after, the one torch decorated."""
    from dfm.platform.compat.dynamo_on_demand import step_until_dynamo, undecorated_until_dynamo

    if imported:
        monkeypatch.setitem(sys.modules, "torch._dynamo", sys.modules.get("torch._dynamo", object()))
    else:
        monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    calls = []

    def method(self):
        calls.append(("method", torch.is_grad_enabled()))

    def inner(self):  # torch._disable_dynamo's wrapper is named inner, _use_grad_for_differentiable's _use_grad
        calls.append("decorated")

    def _use_grad(self):
        if self is None:  # never: the names the check looks for in torch's wrapper
            torch.set_grad_enabled(torch._dynamo.graph_break())
        calls.append("decorated")

    inner.__wrapped__ = _use_grad.__wrapped__ = method
    owner = type("Owner", (), {"defaults": {"differentiable": False}})()
    undecorated_until_dynamo(inner)(owner)
    step_until_dynamo(_use_grad)(owner)
    assert calls == ["decorated"] * 2 if imported else [("method", True), ("method", False)]


def test_boto3_runs_when_tensorboard_first_opens_an_s3_path(probes):
    """TensorBoard (imported by megatron's timers) still sees S3 support; boto3's code runs on first use."""
    assert probes[BOTO3_PROBE] == ["_RunsOnFirstUse", "False", "True", "client", "True"]


ROOT = Path(__file__).resolve().parents[2]


def top_level_imports(path: Path) -> list[str]:
    """The top-level packages a script imports, in order."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module.split(".")[0])
    return names


def test_every_script_imports_dfm_before_megatron():
    """A script (a worker, an entry point) that imports megatron before dfm pays megatron's start-up
    imports in every process it runs as (~2 s each: the hook is installed by ``import dfm``)."""
    late = []
    for path in sorted(ROOT.glob("[!.]*/**/*.py")):
        if "__main__" not in path.read_text() or path.parts[len(ROOT.parts)] == "dfm":
            continue
        names = top_level_imports(path)
        if "megatron" in names and names.index("megatron") < (names.index("dfm") if "dfm" in names else len(names)):
            late.append(str(path.relative_to(ROOT)))
    assert late == []


def test_the_deferred_decorator_compiles_once_on_the_first_call(monkeypatch):
    compiled = []

    def fake_compile(function):
        compiled.append(function)
        return lambda *args: function(*args) * 2

    monkeypatch.setattr(torch, "compile", fake_compile)

    def plus_one(x):
        return x + 1

    deferred = compile_on_first_call(plus_one)
    assert compiled == [] and deferred.__wrapped__ is plus_one
    assert deferred(1) == 4 and deferred(2) == 6
    assert compiled == [plus_one]


def test_a_step_torch_already_hooked_keeps_its_step_hooks():
    """Once an optimizer of a class was built, torch wraps its step with the step hooks; the
    replacement keeps them (and the update)."""
    from torch.optim.optimizer import _use_grad_for_differentiable

    from dfm.platform.compat.dynamo_on_demand import step_until_dynamo

    class Plain(torch.optim.SGD):  # its own step, as torch decorates it: torch.optim.SGD is left alone
        step = _use_grad_for_differentiable(inspect.unwrap(torch.optim.SGD.step))

    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = Plain([weight], lr=0.5)
    assert Plain.step.hooked
    seen = []
    optimizer.register_step_pre_hook(lambda *_: seen.append("pre"))
    Plain.step = step_until_dynamo(Plain.step)
    weight.grad = torch.ones(2)
    optimizer.step()
    assert Plain.step.hooked and seen == ["pre"] and weight.tolist() == [0.5, 0.5]
    assert step_until_dynamo(Plain.step) is Plain.step  # a second install leaves it as it is
