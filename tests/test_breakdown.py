"""The agent's memory breakdown, `count_optimizer_memory()`, on a CPU build of torch.

The function walks optimizers' param_groups, `.grad` and `state`, and tells storages apart by
address.  The expectations here come by other routes: sizes computed from the architecture,
`model.parameters()` (which torch deduplicates by identity), `optimizer.state_dict()`, and
`numel() * element_size()` instead of storage sizes.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from memtop.agent.probe import Breakdown  # noqa: E402
from memtop.agent.torch_probe import RoleBytes, TorchProbe, count_optimizer_memory  # noqa: E402

VOCAB, WIDTH, LAYERS = 50, 16, 2
CPU = -1  # the key of CPU tensors (torch's get_device() for "no index")

# From the architecture, not from the tensors: what the optimizers train (fp32) ...
EMBED_ELEMENTS = VOCAB * WIDTH  # shared with the output layer
BLOCK_ELEMENTS = 2 * WIDTH + (WIDTH * 2 * WIDTH + 2 * WIDTH) + (2 * WIDTH * WIDTH + WIDTH)
TRAINED_BYTES = 4 * (EMBED_ELEMENTS + LAYERS * BLOCK_ELEMENTS + 2 * WIDTH)
TRAINED_TENSORS = 1 + LAYERS * 6 + 2
# ... the frozen bf16 adapter, a parameter group of its own with lr 0 ...
FROZEN_BYTES = 2 * (WIDTH * WIDTH + WIDTH)
# ... and the gate, which is in no optimizer.
GATE_BYTES = 4 * WIDTH


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(WIDTH),
                nn.Linear(WIDTH, 2 * WIDTH),
                nn.GELU(),
                nn.Linear(2 * WIDTH, WIDTH),
            )
            for _ in range(LAYERS)
        )
        self.adapter = nn.Linear(WIDTH, WIDTH).to(torch.bfloat16).requires_grad_(False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.gate = nn.Parameter(torch.ones(WIDTH))  # trained by no optimizer, but has a grad

    def forward(self, tokens: Any) -> Any:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        h = h + self.adapter(h.to(torch.bfloat16)).float()
        return self.head(self.norm(h) * self.gate)

    def trained(self) -> list[Any]:
        return [
            p
            for name, p in self.named_parameters()
            if not name.startswith("adapter.") and name != "gate"
        ]

    def param_groups(self) -> list[dict[str, Any]]:
        return [
            {"params": self.trained()},
            {"params": list(self.adapter.parameters()), "lr": 0.0},
        ]


def train(model: TinyLM, optimizers: Iterable[Any], steps: int = 2) -> None:
    optimizers = list(optimizers)
    torch.manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 8))
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()


def nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def unique(tensors: Iterable[Any]) -> list[Any]:
    return list({id(t): t for t in tensors}.values())


def state_dict_bytes(optimizer: Any) -> int:
    """Optimizer state as optimizer.state_dict() reports it (tensors in it are the state's own)."""
    return sum(
        nbytes(value)
        for state in optimizer.state_dict()["state"].values()
        for value in state.values()
        if torch.is_tensor(value)
    )


def independent_counts(model: TinyLM, optimizers: list[Any]) -> RoleBytes:
    in_optimizers = unique(p for o in optimizers for g in o.param_groups for p in g["params"])
    # model.parameters() drops the tied head.weight by identity; the gate is in no optimizer.
    params = [p for p in model.parameters() if any(p is q for q in in_optimizers)]
    return RoleBytes(
        parameters=sum(nbytes(p) for p in params),
        gradients=sum(nbytes(p.grad) for p in params if p.grad is not None),
        optimizer_state=sum(state_dict_bytes(o) for o in optimizers),
        fp32_parameter_bytes=sum(nbytes(p) for p in params if p.dtype == torch.float32),
    )


OPTIMIZERS = {
    # Adam: exp_avg and exp_avg_sq like the parameter, plus `step`, a float32 scalar tensor.
    "adam": (
        lambda groups: torch.optim.Adam(groups, lr=1e-3),
        2 * TRAINED_BYTES + 4 * TRAINED_TENSORS,
    ),
    # SGD with momentum: one momentum buffer per parameter that had a gradient.
    "sgd": (lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9), TRAINED_BYTES),
}


@pytest.fixture(params=sorted(OPTIMIZERS))
def trained(request: pytest.FixtureRequest) -> tuple[TinyLM, Any, int]:
    make, state_bytes = OPTIMIZERS[request.param]
    model = TinyLM()
    optimizer = make(model.param_groups())
    train(model, [optimizer])
    return model, optimizer, state_bytes


# ------------------------------------------------------------------ against independent counts


@pytest.mark.slow
def test_counts_match_the_architecture_and_an_independent_count(trained):
    model, optimizer, state_bytes = trained
    counts = count_optimizer_memory([optimizer], device_type="cpu")
    assert set(counts) == {CPU}
    assert counts[CPU] == RoleBytes(
        parameters=TRAINED_BYTES + FROZEN_BYTES,
        gradients=TRAINED_BYTES,  # the frozen adapter has none; the gate's is not reached
        optimizer_state=state_bytes,
        fp32_parameter_bytes=TRAINED_BYTES,
    )
    assert counts[CPU] == independent_counts(model, [optimizer])
    assert model.gate.grad is not None  # so leaving the gate out is a real decision


def test_only_the_requested_device_type_counts(trained):
    _, optimizer, _ = trained
    assert count_optimizer_memory([optimizer], device_type="cuda") == {}
    assert count_optimizer_memory([optimizer]) == {}  # CUDA is the default
    assert count_optimizer_memory([optimizer], device_type="cpu") != {}


@pytest.mark.slow
def test_fp32_parameter_bytes_leave_out_the_bf16_parameters(trained):
    model, optimizer, _ = trained
    assert model.adapter.weight.dtype == torch.bfloat16
    counts = count_optimizer_memory([optimizer], device_type="cpu")[CPU]
    assert counts.parameters - counts.fp32_parameter_bytes == FROZEN_BYTES
    half = sum(nbytes(p) for p in model.adapter.parameters())
    assert counts.parameters - counts.fp32_parameter_bytes == half


def test_zero_grad_set_to_none_leaves_no_gradient_bytes(trained):
    _, optimizer, _ = trained
    before = count_optimizer_memory([optimizer], device_type="cpu")[CPU]
    assert before.gradients == TRAINED_BYTES
    optimizer.zero_grad(set_to_none=False)  # zeros are still gradients
    assert count_optimizer_memory([optimizer], device_type="cpu")[CPU] == before
    optimizer.zero_grad(set_to_none=True)
    after = count_optimizer_memory([optimizer], device_type="cpu")[CPU]
    assert after.gradients == 0
    assert after.parameters == before.parameters
    assert after.optimizer_state == before.optimizer_state


def test_two_optimizers_sharing_nothing_add_up():
    model = TinyLM()
    adam = torch.optim.Adam([p for b in model.blocks for p in b.parameters()], lr=1e-3)
    rest = [model.embed.weight, *model.norm.parameters()]
    sgd = torch.optim.SGD(
        [{"params": rest}, {"params": list(model.adapter.parameters()), "lr": 0.0}],
        lr=1e-2,
        momentum=0.9,
    )
    train(model, [adam, sgd])
    both = count_optimizer_memory([adam, sgd], device_type="cpu")[CPU]
    a = count_optimizer_memory([adam], device_type="cpu")[CPU]
    s = count_optimizer_memory([sgd], device_type="cpu")[CPU]
    block_bytes = 4 * LAYERS * BLOCK_ELEMENTS
    assert a.parameters == a.gradients == block_bytes
    assert a.optimizer_state == 2 * block_bytes + 4 * LAYERS * 6
    assert s.parameters == TRAINED_BYTES - block_bytes + FROZEN_BYTES
    assert s.optimizer_state == TRAINED_BYTES - block_bytes
    assert both == RoleBytes(
        parameters=a.parameters + s.parameters,
        gradients=a.gradients + s.gradients,
        optimizer_state=a.optimizer_state + s.optimizer_state,
        fp32_parameter_bytes=a.fp32_parameter_bytes + s.fp32_parameter_bytes,
    )
    assert both == independent_counts(model, [adam, sgd])
    assert count_optimizer_memory([sgd, adam], device_type="cpu")[CPU] == both


# ------------------------------------------------------------------ each storage once


def test_tied_weights_count_once():
    model = TinyLM()
    assert model.head.weight is model.embed.weight
    listed = sum(nbytes(p) for _, p in model.named_parameters(remove_duplicate=False))
    tied = nbytes(model.embed.weight)
    optimizer = torch.optim.Adam(model.param_groups(), lr=1e-3)
    train(model, [optimizer], steps=1)
    counts = count_optimizer_memory([optimizer], device_type="cpu")[CPU]
    assert counts.parameters == listed - tied - GATE_BYTES
    assert counts.gradients == TRAINED_BYTES

    # The same parameter in two optimizers, and two parameters over one storage.
    first = torch.optim.SGD([model.embed.weight], lr=0.1)
    second = torch.optim.SGD([model.head.weight], lr=0.1)
    assert count_optimizer_memory([first, second], "cpu")[CPU].parameters == tied
    base = torch.randn(8, 4)
    whole, half = nn.Parameter(base), nn.Parameter(base[:4].detach())
    assert half.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    views = torch.optim.SGD([whole, half], lr=0.1)
    assert count_optimizer_memory([views], "cpu")[CPU].parameters == nbytes(base)


def test_a_view_counts_the_whole_storage_it_keeps_alive():
    flat = torch.zeros(100)  # one buffer holding several parameters, as flat-parameter schemes do
    first, second = nn.Parameter(flat[:10]), nn.Parameter(flat[10:30])
    counts = count_optimizer_memory([torch.optim.SGD([first], lr=0.1)], "cpu")[CPU]
    assert counts.parameters == counts.fp32_parameter_bytes == nbytes(flat)
    counts = count_optimizer_memory([torch.optim.SGD([first, second], lr=0.1)], "cpu")[CPU]
    assert counts.parameters == nbytes(flat)


def test_a_storage_in_several_roles_counts_in_the_first_of_parameters_gradients_state():
    a, b, c = (nn.Parameter(torch.randn(6, 5)) for _ in range(3))
    size = nbytes(a)
    opt_first, opt_second = torch.optim.SGD([a, c], lr=0.1), torch.optim.SGD([b], lr=0.1)
    c.grad = torch.randn(6, 5)
    a.grad = b.detach()  # a gradient that is another optimizer's parameter: a parameter
    opt_first.state[a]["alias"] = b.detach()[1:]  # state that is a parameter: a parameter
    opt_first.state[c]["alias"] = c.grad  # state that is a gradient: a gradient
    opt_first.state[c]["own"] = torch.randn(6, 5)
    expected = RoleBytes(
        parameters=3 * size, gradients=size, optimizer_state=size, fp32_parameter_bytes=3 * size
    )
    # Whichever optimizer comes first: the priority holds across optimizers.
    assert count_optimizer_memory([opt_first, opt_second], "cpu") == {CPU: expected}
    assert count_optimizer_memory([opt_second, opt_first], "cpu") == {CPU: expected}
    assert count_optimizer_memory([opt_first, opt_first, opt_second], "cpu") == {CPU: expected}


def test_state_tensors_one_level_inside_lists_tuples_and_dicts_count():
    p = nn.Parameter(torch.randn(3, 3))
    optimizer = torch.optim.SGD([p], lr=0.1)
    history = [torch.randn(10), torch.randn(20, dtype=torch.float64)]
    pair = (torch.randn(7), 0.5)
    named = {"scale": torch.ones(5, dtype=torch.float16), "note": "text"}
    optimizer.state[p].update(
        history=history, pair=pair, named=named, lr=0.1, name="x", nothing=None
    )
    counts = count_optimizer_memory([optimizer], "cpu")[CPU]
    assert counts.optimizer_state == 10 * 4 + 20 * 8 + 7 * 4 + 5 * 2
    assert counts.parameters == nbytes(p)


# ------------------------------------------------------------------ what cannot be read


class Unreadable(torch.Tensor):
    """A tensor subclass without a storage to read (as some wrapper subclasses are)."""

    def untyped_storage(self) -> Any:  # type: ignore[override]
        raise RuntimeError("no storage here")


def test_tensors_without_a_readable_storage_are_skipped():
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = nn.Parameter(torch.randn(4, 4))
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.randn(4, 4)
    optimizer.step()
    before = count_optimizer_memory([optimizer], "cpu")
    assert before[CPU].optimizer_state == nbytes(p)  # the momentum buffer

    with FakeTensorMode():
        fake = torch.empty(1000)  # says "cpu", has no data
    assert fake.is_cpu
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (1000,), check_invariants=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        csr = torch.eye(30).to_sparse_csr()
    unreadable = torch.randn(1000).as_subclass(Unreadable)
    with pytest.raises(RuntimeError):
        unreadable.untyped_storage()
    with pytest.raises(NotImplementedError):
        sparse.untyped_storage()
    optimizer.state[p].update(
        sparse=sparse,
        csr=csr,
        fake=fake,
        meta=torch.empty(1000, device="meta"),
        unreadable=unreadable,
        empty=torch.empty(0),
        listed=[sparse, unreadable, torch.randn(3)],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after = count_optimizer_memory([optimizer], "cpu")
    assert after[CPU].optimizer_state == nbytes(p) + 3 * 4  # only the readable one in the list
    assert after[CPU].parameters == before[CPU].parameters
    # A fake tensor's data_ptr() warns: it is recognised before it is asked.
    assert [str(w.message) for w in caught] == []

    meta = nn.Linear(100, 100, device="meta")
    assert count_optimizer_memory([torch.optim.SGD(meta.parameters(), lr=0.1)], "meta") == {}


def test_what_is_not_an_optimizer_is_skipped_without_raising(trained):
    _, optimizer, _ = trained

    class Broken:
        @property
        def param_groups(self) -> list[Any]:
            raise RuntimeError("mid-step")

    class Odd:
        def __init__(self) -> None:
            self.param_groups = [{"params": [None, "x", 3]}]
            self.state = {0: "not a dict", 1: None}

    alone = count_optimizer_memory([optimizer], "cpu")
    assert count_optimizer_memory([Broken(), object(), Odd(), optimizer], "cpu") == alone
    assert count_optimizer_memory([], "cpu") == {}


# ------------------------------------------------------------------ through TorchProbe's hook


def test_the_probe_counts_the_optimizers_its_step_hook_collected():
    probe = TorchProbe()
    try:
        assert probe.install_step_hook(lambda: None)
        model = TinyLM()
        adam = torch.optim.Adam([p for b in model.blocks for p in b.parameters()], lr=1e-3)
        sgd = torch.optim.SGD([model.embed.weight, *model.norm.parameters()], lr=1e-2)
        never_stepped = torch.optim.Adam(model.adapter.parameters(), lr=1e-3)
        assert probe.collected_optimizers() == []
        train(model, [adam], steps=1)
        assert probe.collected_optimizers() == [adam]
        assert probe.breakdown_by_device("cpu") == count_optimizer_memory([adam], "cpu")
        assert probe.breakdown_by_device("cpu") == {CPU: independent_counts(model, [adam])}

        train(model, [adam, sgd], steps=1)
        collected = probe.collected_optimizers()
        assert len(collected) == 2 and adam in collected and sgd in collected
        assert never_stepped not in collected
        counts = probe.breakdown_by_device("cpu")
        assert counts == {CPU: independent_counts(model, [adam, sgd])}
        assert counts[CPU].parameters == TRAINED_BYTES  # not the never-stepped adapter
        assert probe.breakdown() == {}  # breakdown() reports CUDA memory only

        del adam, sgd, collected
        gc.collect()
        assert probe.collected_optimizers() == []  # held weakly
        assert probe.breakdown_by_device("cpu") == {}
    finally:
        probe.remove_step_hook()  # torch's step post-hooks are process-global


def test_probe_breakdown_counts_cuda_and_adds_allocated(monkeypatch: pytest.MonkeyPatch):
    probe = TorchProbe()
    asked: list[str] = []

    def by_device(device_type: str = "cuda") -> dict[int, RoleBytes]:
        asked.append(device_type)
        return {
            1: RoleBytes(parameters=100, gradients=50, optimizer_state=200, fp32_parameter_bytes=60)
        }

    monkeypatch.setattr(probe, "breakdown_by_device", by_device)
    monkeypatch.setattr(probe, "memory_allocated", lambda index: 1000 + index)
    assert probe.breakdown() == {
        1: Breakdown(
            parameters=100,
            gradients=50,
            optimizer_state=200,
            allocated=1001,
            fp32_parameter_bytes=60,
        )
    }
    assert asked == ["cuda"]
    assert probe.breakdown()[1].other == 1001 - 350
