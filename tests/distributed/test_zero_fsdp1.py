"""DeepSpeed ZeRO and FSDP1 helpers (headwatch.distributed.zero, .fsdp1) in one process.

ZeRO: Parameters carry DeepSpeed's marks (``ds_id``, ``_hp_mapping``) and a stand-in ``deepspeed`` module
records what headwatch asks of it (DeepSpeed itself is not installed here; tests/distributed/test_deepspeed.py runs it
where it is). FSDP1: a real ``FullyShardedDataParallel`` on a one-process gloo group (FileStore, no port):
units, the modules they hold, summoning (lazily initialised root, nested calls), gradients inside
``with_grads`` against an unwrapped twin's autograd, and the refusal when the model was wrapped after
headwatch attached. The two-process runs are tests/distributed/test_fsdp.py."""

from __future__ import annotations

import sys
import types
import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn

from headwatch import HeadwatchError
from headwatch.distributed import fsdp1
from headwatch.distributed.reduce import NoReducer, TorchDistributedReducer
from headwatch.distributed.zero import full_gradient, full_weight, gathered, zero_stage

V, D = 10, 4


# ---------------------------------------------------------------- ZeRO marks
def marked(stage: int, shape=(V, D), **attrs) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape))
    if stage == 3:
        p.ds_id, p.ds_shape = 0, torch.Size(shape)
    elif stage == 1:
        p._hp_mapping = attrs.pop("mapping", None)
        p._index_in_param_group = 0
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


class Mapping:
    def __init__(self, holds: bool) -> None:
        self.holds = holds

    def get_lp_grad_fragment(self, index: int) -> torch.Tensor:
        if not self.holds:
            raise ValueError("no gradient fragment: the optimizer stepped")
        return torch.zeros(1)


class Z3Optimizer:
    def __init__(self, averaged, offload: bool = False) -> None:
        self.offload_optimizer = offload
        self.grad_position = {7: (0,)}
        self.averaged_gradients = {0: averaged}

    def get_param_id(self, param) -> int:
        return 7


class Disagree:
    """Another process's answer: not ready there."""

    world_size, rank = 2, 0

    def all(self, flag: bool) -> bool:
        return False


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """A stand-in ``deepspeed`` recording its calls: ``utils.safe_get_full_grad`` and ``zero.GatheredParameters``."""
    calls: dict[str, list] = {"grad": [], "gathered": []}
    answer = {"grad": torch.full((V, D), 0.25)}

    def safe_get_full_grad(param):
        calls["grad"].append(param)
        return answer["grad"]

    @contextmanager
    def GatheredParameters(params):
        calls["gathered"].append(list(params))
        yield

    module = types.ModuleType("deepspeed")
    module.utils = types.SimpleNamespace(safe_get_full_grad=safe_get_full_grad)
    module.zero = types.SimpleNamespace(GatheredParameters=GatheredParameters)
    utils = types.ModuleType("deepspeed.utils")
    utils.safe_get_full_grad = safe_get_full_grad
    monkeypatch.setitem(sys.modules, "deepspeed", module)
    monkeypatch.setitem(sys.modules, "deepspeed.utils", utils)
    return calls, answer


def test_zero_stage_from_the_marks():
    assert zero_stage(None) == 0 and zero_stage(nn.Parameter(torch.zeros(2))) == 0
    assert zero_stage(marked(3)) == 3 and zero_stage(marked(1)) == 1


def test_plain_parameters_give_their_grad_without_deepspeed():
    p = nn.Parameter(torch.ones(V, D))
    assert full_gradient(p) is None and full_gradient(None) is None
    p.grad = torch.full((V, D), 2.0)
    assert full_gradient(p, NoReducer()) is p.grad
    frozen = marked(3)
    frozen.requires_grad_(False)
    assert full_gradient(frozen) is None  # a frozen ZeRO Parameter has no gradient to read
    assert full_weight(p) is p and full_weight(None) is None


@pytest.mark.parametrize(
    "param, stage",
    [
        (marked(3, _z3_optimizer=Z3Optimizer(averaged=None)), "3"),  # averaged_gradients cleared by step()
        (marked(1, mapping=Mapping(holds=False)), "1 or 2"),  # no fragment left
    ],
    ids=["stage3", "stage1"],
)
def test_a_gradient_read_after_the_optimizer_step_is_refused(param, stage, fake_deepspeed):
    with pytest.raises(HeadwatchError, match=rf"ZeRO stage {stage} holds this matrix's gradient .* `engine.step\(\)` already ran"):
        full_gradient(param, NoReducer())
    assert fake_deepspeed[0]["grad"] == []  # refused before any collective


def test_every_process_agrees_before_the_collective(fake_deepspeed):
    ready = marked(3, _z3_optimizer=Z3Optimizer(averaged=torch.zeros(1)))
    with pytest.raises(HeadwatchError, match="engine.step"):
        full_gradient(ready, Disagree())  # ready here, not on another process: nobody enters the collective
    assert fake_deepspeed[0]["grad"] == []


@pytest.mark.parametrize(
    "param",
    [
        marked(3, _z3_optimizer=Z3Optimizer(averaged=torch.zeros(1))),
        marked(3, _z3_optimizer=Z3Optimizer(averaged=None, offload=True)),  # offload: trust DeepSpeed
        marked(3),  # no optimizer attributes (another version): trust DeepSpeed
        marked(1, mapping=Mapping(holds=True)),
        marked(1, mapping=None),  # this process holds no fragment
    ],
    ids=["stage3", "offload", "unknown", "stage1", "no_fragment"],
)
def test_a_ready_gradient_is_read_with_safe_get_full_grad_and_said_once(param, fake_deepspeed):
    calls, answer = fake_deepspeed
    said: list[str] = []
    got = full_gradient(param, NoReducer(), say=said.append)
    assert got is answer["grad"] and calls["grad"] == [param]
    assert len(said) == 1 and "safe_get_full_grad" in said[0] and "(vocab_size, d_model) float32" in said[0]
    answer["grad"] = None
    with pytest.raises(HeadwatchError, match="returned None for a trained matrix"):
        full_gradient(param)


def test_full_weight_of_a_zero3_parameter_is_a_gathered_float32_copy(fake_deepspeed):
    calls, _ = fake_deepspeed
    p = marked(3)
    with torch.no_grad():
        p.copy_(torch.arange(V * D, dtype=torch.float32).reshape(V, D))
    p.data = p.data.to(torch.bfloat16)
    got = full_weight(p)
    assert calls["gathered"] == [[p]]
    assert got.dtype == torch.float32 and got.data_ptr() != p.data_ptr()
    assert torch.equal(got, p.detach().float())


def test_gathered_gathers_only_the_vocabulary_matrices(fake_deepspeed):
    calls, _ = fake_deepspeed
    model = nn.Module()
    model.tok, model.lm_head, model.mid = nn.Embedding(V, D), nn.Linear(D, V, bias=False), nn.Linear(D, D)
    model.proj_in = nn.Linear(V, D, bias=False)  # (D, V): shares a dimension with the vocabulary
    plain = nn.Module()
    plain.tok = nn.Embedding(V, D)
    with gathered(plain):
        pass
    assert calls["gathered"] == []  # no ZeRO-3 Parameter: nothing asked of DeepSpeed
    for module in (model.tok, model.lm_head, model.mid, model.proj_in):
        module.weight.ds_id, module.weight.ds_shape = 0, module.weight.shape
    with gathered(model):
        pass
    assert {id(p) for p in calls["gathered"][0]} == {id(model.tok.weight), id(model.lm_head.weight), id(model.proj_in.weight)}


# ---------------------------------------------------------------- FSDP1 on one process
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(V, D)
        self.block = Block()
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.block(self.tok(ids)))


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch built without distributed")
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("fsdp1") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def wrap(model: nn.Module, orig: bool = True) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process: FSDP says it falls back to NO_SHARD
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=orig,
                                        auto_wrap_policy=ModuleWrapPolicy({Block}))


def test_plain_models_are_no_ops_for_fsdp1():
    model = LM()
    assert fsdp1.units(model) == [] and fsdp1.units(None) == []
    assert fsdp1.unwrapped(model) is model and fsdp1.holding_units(model, [model.lm_head]) == []
    assert fsdp1.uses_orig_params(model) and fsdp1.uses_orig_params(None)
    with fsdp1.full_matrices(model, [model.lm_head, None], with_grads=True):
        assert model.lm_head.weight.shape == (V, D)


def test_a_one_process_torch_reducer_on_an_initialized_group(group):
    reducer = TorchDistributedReducer()
    assert (reducer.world_size, reducer.rank) == (1, 0)
    x = torch.tensor([2.0, 3.0])
    assert torch.equal(reducer.sum(x), x) and torch.equal(reducer.mean(x), x)
    assert reducer.gather(x)[0] is x and reducer.all(True) and not reducer.all(False)


def test_units_and_the_modules_they_hold(group):
    model = LM()
    root = wrap(model)
    found = fsdp1.units(root)
    assert len(found) == 2 and found[0] is root  # outermost first
    assert fsdp1.unwrapped(root) is model
    assert fsdp1.holding_units(root, [model.lm_head]) == [root]
    assert fsdp1.holding_units(root, [model.block.lin]) == [found[1]]
    assert fsdp1.holding_units(root, [model.tok, None, model.block]) == found
    assert fsdp1.uses_orig_params(root)
    assert not fsdp1.uses_orig_params(wrap(LM(), orig=False))


def test_full_matrices_before_the_first_forward_nested_and_for_resolution(group):
    model = LM()
    root = wrap(model)
    with fsdp1.full_matrices(root, None):  # resolution, before any forward: the root is initialised lazily
        assert model.lm_head.weight.shape == (V, D) and model.tok.weight.shape == (V, D)
        with fsdp1.full_matrices(root, [model.lm_head, model.tok]):  # nested: reuses the outer summon
            assert model.tok.weight.shape == (V, D)
    out = root(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, V)


def test_gradients_inside_with_grads_equal_an_unwrapped_twins_autograd(group):
    twin = LM()
    model = LM()
    root = wrap(model)
    ids = torch.tensor([[1, 4, 4, 9], [0, 2, 3, 3]])
    targets = torch.tensor([[4, 4, 9, 1], [2, 3, 3, 0]])
    for net in (root, twin):
        nn.functional.cross_entropy(net(ids).reshape(-1, V), targets.reshape(-1)).backward()
    with fsdp1.full_matrices(root, [model.lm_head, model.tok], with_grads=True):
        torch.testing.assert_close(model.lm_head.weight.grad, twin.lm_head.weight.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(model.tok.weight.grad, twin.tok.weight.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("orig", [True, False])
def test_a_model_wrapped_after_attaching_is_refused_with_the_fix(group, orig):
    model = LM()
    wrap(model, orig=orig)
    with pytest.raises(HeadwatchError, match=r"wrapped the model after headwatch attached.*create headwatch.Headwatch on the wrapped model") as err:
        with fsdp1.full_matrices(model, [model.lm_head]):  # the inner model: no unit of it holds the head
            pass
    assert err.value.warn_key == "fsdp1_wrapped_after"
